"""Kimi-K2.5 (``kimi_k25``): a multimodal wrapper whose text model (``text_config``, ``kimi_k2``) is DeepSeek-V3's
architecture, its tensors under ``language_model.``. The policy is that text model: its weights load through the
bridge under their prefix (logits = transformers' for the same weights, <= 1e-4), export under it bit for bit, and
conversion carries the vision tower and projector through untouched (never trained). A tiny checkpoint is written
from the tiny DeepSeek-V3 model with its tensors renamed (``hf_tiny.save_kimi_k25``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gspo_megatron.model import mapping
from gspo_megatron.model.errors import UnsupportedModel
from gspo_megatron.model.hf_config import read_hf_config
from gspo_megatron.model.hf_files import SafetensorsDir
from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from tests.model import hf_tiny

ATOL = 1e-4


@pytest.fixture(scope="module")
def kimi_k25(hf_models, tmp_path_factory):
    return hf_tiny.save_kimi_k25(hf_models["deepseek_v3"], tmp_path_factory.mktemp("kimi") / "kimi_k25")


def test_config_is_the_text_model_under_its_prefix(kimi_k25, hf_models):
    spec = read_hf_config(kimi_k25)
    text = read_hf_config(hf_models["deepseek_v3"])
    assert spec.weights_prefix == "language_model." and spec.family == "deepseek_v3"
    assert spec.to_dict() == {**text.to_dict(), "weights_prefix": "language_model."}
    names = SafetensorsDir(kimi_k25).shapes()
    carried = sorted(n for n in names if mapping.is_carried(spec, n))
    assert [n for n in carried if not n.startswith("language_model.")] == [
        "mm_projector.proj.0.weight", "vision_tower.encoder.blocks.0.wqkv.weight", "vision_tower.patch_embed.proj.weight"]
    # the tiny DeepSeek-V3's MTP layer (layer 2), under the prefix too
    assert {n for n in carried if n.startswith("language_model.")} == {
        n for n in names if n.startswith("language_model.model.layers.2.")}
    assert set(mapping.hf_tensor_shapes(spec)) == set(names) - set(carried)
    with pytest.raises(UnsupportedModel, match="without a text_config object"):
        read_hf_config({"model_type": "kimi_k25", "vision_config": {}})


def _load_export_convert(hf_dir: str, reference: str, work: str) -> dict:
    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.convert import hf_to_megatron, megatron_to_hf
    from gspo_megatron.model.process_groups import ensure_model_parallel
    from gspo_megatron.model.provider import build_gpt_model
    from tests.model.rank_checks import megatron_logits

    ensure_model_parallel(Layout())
    spec, files = read_hf_config(hf_dir), SafetensorsDir(hf_dir)
    bridge = Bridge(spec)
    model = build_gpt_model(spec, Layout())
    bridge.load_hf_weights(model, hf_dir)
    expected = torch.load(reference)
    logits = megatron_logits(model, expected["tokens"])[..., : spec.vocab_size]
    exported = list(bridge.export_hf_weights(model))
    hf_to_megatron(hf_dir, f"{work}/megatron", Layout())
    megatron_to_hf(f"{work}/megatron", f"{work}/hf_back", hf_dir, Layout())
    back = SafetensorsDir(f"{work}/hf_back")
    return {"logits_diff": (logits - expected["logits"]).abs().max().item(),
            "exported": sorted(n for n, _ in exported),
            "not_bitwise": [n for n, t in exported if not hf_tiny.same_bits(t, files.read(n))],
            "back": sorted(back.shapes()),
            "back_not_bitwise": [n for n in back.shapes() if not hf_tiny.same_bits(back.read(n), files.read(n))]}


@pytest.mark.megatron  # builds a Megatron model and converts
def test_text_model_loads_exports_and_converts_with_the_vision_tower_carried(kimi_k25, hf_models, tmp_path):
    reference = Path(hf_models["deepseek_v3"]).parent / "deepseek_v3.reference.pt"
    (r,) = run_on_ranks(_load_export_convert, 1, None, str(kimi_k25), str(reference), str(tmp_path))
    spec = read_hf_config(kimi_k25)
    names = sorted(SafetensorsDir(kimi_k25).shapes())
    assert r["logits_diff"] <= ATOL, r["logits_diff"]
    assert r["exported"] == sorted(n for n in names if not mapping.is_carried(spec, n)) and not r["not_bitwise"], r
    assert r["back"] == names and not r["back_not_bitwise"], r["back_not_bitwise"]


def test_training_config_is_validated_against_the_text_model(kimi_k25):
    import json

    from gspo_megatron.train.startup.config import ConfigError, load_config
    from gspo_megatron.train.startup.validate import validate

    hf = json.loads((Path(kimi_k25) / "config.json").read_text())
    with pytest.raises(ConfigError, match="n_routed_experts=8 is not divisible by parallel.expert=3"):
        validate(load_config(None, ["data.task=count", "parallel.expert=3"]), 3, hf)
