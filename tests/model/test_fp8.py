"""Block-scaled FP8 checkpoints (``model.fp8``): the tiny DeepSeek-V3 model quantized here as DeepSeek-V3's are
(float8_e4m3fn linear weights, one fp32 ``weight_scale_inv`` per block, bf16 for the rest; blocks of 16 x 12 so edge
blocks are partial), then read back: every tensor the bridge sees equals its dequantized reference (written out
block by block below) bit for bit, the scales are hidden, and converting to Megatron and back (world=1) and
``score`` give exactly what the dequantized bf16 checkpoint gives.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from gspo_megatron.model.bridge import Bridge
from gspo_megatron.model.hf_config import read_hf_config
from gspo_megatron.model.hf_files import SafetensorsDir, open_hf_dir
from tests.model import hf_tiny

BLOCK = (16, 12)
# DeepSeek-V3 quantizes the linear weights of attention and MLPs, not embeddings, norms, the router or lm_head.
QUANTIZED = ("proj.weight", "proj_with_mqa.weight")


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    scale = torch.empty(math.ceil(rows / BLOCK[0]), math.ceil(cols / BLOCK[1]))
    out = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = weight[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]]
            scale[i, j] = block.abs().max() / 448.0
            out[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]] = block / scale[i, j]
    return out, scale


def _reference(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block by block: each block's fp8 values times its scale, in bf16."""
    out = torch.empty(fp8.shape, dtype=torch.bfloat16)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            out[rows, cols] = (fp8[rows, cols].float() * scale[i, j]).to(torch.bfloat16)
    return out


@pytest.fixture(scope="module")
def fp8_models(hf_models, tmp_path_factory):
    """(FP8 directory, its dequantized bf16 twin, {name: reference}) from the tiny DeepSeek-V3 model."""
    from safetensors.torch import load_file, save_file

    source = hf_models["deepseek_v3"]
    work = tmp_path_factory.mktemp("fp8")
    quantized, dequantized = work / "fp8", work / "dequantized"
    for target in (quantized, dequantized):
        shutil.copytree(source, target)
    tensors, plain, references = {}, {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(QUANTIZED):
            fp8, scale = _quantize(tensor)
            tensors[name], tensors[name + "_scale_inv"] = fp8, scale
            plain[name] = references[name] = _reference(fp8, scale)
        else:  # norms, embeddings, router, lm_head: bf16 (the router bias stays fp32, as transformers keeps it)
            keep = tensor.dtype if name.endswith("e_score_correction_bias") else torch.bfloat16
            tensors[name] = plain[name] = tensor.to(keep)
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, dequantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (dequantized / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, dequantized, references


def test_fp8_weights_read_as_their_dequantized_reference(fp8_models):
    quantized, dequantized, references = fp8_models
    raw, source = SafetensorsDir(quantized), open_hf_dir(quantized)
    assert sum(d == torch.float8_e4m3fn for d in raw.dtypes().values()) == len(references) > 10
    assert not any(n.endswith("_scale_inv") for n in source.shapes())
    plain = SafetensorsDir(dequantized)
    assert source.shapes() == plain.shapes() and source.dtypes() == plain.dtypes()
    Bridge(read_hf_config(quantized)).check_hf_tensors(source.shapes())
    for name in source.shapes():
        assert hf_tiny.same_bits(source.read(name), plain.read(name)), name
    for name, reference in references.items():
        assert hf_tiny.same_bits(source.read(name), reference), name
        rows = (slice(reference.shape[0] // 2, None), slice(None))  # a TP rank's slice of the dequantized weight
        assert hf_tiny.same_bits(source.read(name, rows), reference[rows]), name


def _convert_and_score(quantized: str, dequantized: str, megatron_dir: str, back: str) -> dict:
    from gspo_megatron.model.convert import hf_to_megatron, megatron_to_hf
    from gspo_megatron.parallel.groups import Layout
    from gspo_megatron.score import score_on_this_rank
    from tests.model.rank_checks import score_records_for_tests

    hf_to_megatron(quantized, megatron_dir, Layout())
    megatron_to_hf(megatron_dir, back, None, Layout())
    records = score_records_for_tests(read_hf_config(quantized).vocab_size)
    return {"fp8": score_on_this_rank(quantized, records, Layout(), 2, None),
            "dequantized": score_on_this_rank(dequantized, records, Layout(), 2, None)}


@pytest.mark.megatron
def test_fp8_checkpoint_converts_and_scores_as_its_dequantized_twin(fp8_models, tmp_path):
    from gspo_megatron.parallel.groups import Layout
    from gspo_megatron.parallel.launch import run_on_ranks

    quantized, dequantized, _ = fp8_models
    back = tmp_path / "back"
    (result,) = run_on_ranks(_convert_and_score, 1, Layout(), str(quantized), str(dequantized),
                             str(tmp_path / "megatron"), str(back), timeout=300)
    exported, plain = SafetensorsDir(back), SafetensorsDir(dequantized)
    assert exported.shapes() == plain.shapes()
    for name in plain.shapes():
        assert hf_tiny.same_bits(exported.read(name), plain.read(name)), name
    config = json.loads((back / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert result["fp8"] == result["dequantized"]  # bf16 log-probs of the same weights: identical
