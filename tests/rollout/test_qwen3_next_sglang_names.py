"""Our Qwen3-Next tensors are what SGLang's ``Qwen3NextForCausalLM`` loads, checked against its own code, in-process
(``sglang_load``, as ``test_minimax_m2_sglang_names`` does): conversion's export (hf -> Megatron -> ``megatron_to_hf``
at world 1, read by SGLang's safetensors iterator) and the weight sync's stream (``Bridge.export_to_sender``, one
tensor a bucket, one ``load_weights`` call each), each loaded into a model whose every parameter was first set to NaN.
Every SGLang parameter must be written whole and equal ours through its joins (``expected_params``): the full-attention
layers' ``qkv_proj`` = [q (with its gate); k; v] and their ``o_proj`` / ``q_norm`` / ``k_norm`` one level up (SGLang's
layer holds them itself, no ``self_attn``), the shared expert's ``gate_up_proj`` = [gate; up], the routed experts'
``w13_weight`` / ``w2_weight`` stacked; the gated DeltaNet's ``in_proj_qkvz``, ``in_proj_ba``, ``conv1d``, ``A_log``,
``dt_bias``, ``norm`` and ``out_proj`` as they are. The export's MTP layer (``mtp.*``, carried from the checkpoint) is
dropped by design (SGLang's ``Qwen3NextForCausalLMMTP`` loads it as the draft model); the stream has none.
The export's config.json carries ``full_attention_interval`` (``hf_config.serving_config``): SGLang's own
``Qwen3NextConfig`` places its layers by it alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.model import hf_tiny

from .helpers import require_sglang
from .test_deepseek_sglang_names import _convert_and_stream, assert_loaded_equal

REPO = Path(__file__).resolve().parents[2]


def expected_params(named: dict[str, torch.Tensor], layers: int, experts: int) -> tuple[dict, list[str]]:
    """SGLang's parameters as its ``load_weights`` builds them from our HF tensors, and the names it drops by design;
    each of ours used once."""
    out, used = {}, set()
    dropped = [name for name in named if name.startswith("mtp.")]
    used.update(dropped)

    def take(*names):
        used.update(names)
        return [named[n] for n in names]

    for i in range(layers):
        layer, attn, moe = f"model.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        if f"{attn}.q_proj.weight" in named:  # a full-attention layer
            out[f"{layer}.qkv_proj.weight"] = torch.cat(take(*(f"{attn}.{p}_proj.weight" for p in "qkv")))
            for rest in ("o_proj.weight", "q_norm.weight", "k_norm.weight"):
                out[f"{layer}.{rest}"] = take(f"{attn}.{rest}")[0]
        shared = f"{moe}.shared_expert"
        out[f"{shared}.gate_up_proj.weight"] = torch.cat(take(f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"))
        out[f"{moe}.experts.w13_weight"] = torch.stack([torch.cat(take(f"{moe}.experts.{e}.gate_proj.weight",
                                                                       f"{moe}.experts.{e}.up_proj.weight"))
                                                        for e in range(experts)])
        out[f"{moe}.experts.w2_weight"] = torch.stack(take(*(f"{moe}.experts.{e}.down_proj.weight"
                                                              for e in range(experts))))
    out.update((name, tensor) for name, tensor in named.items() if name not in used)
    return out, dropped


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    require_sglang()
    from gspo_megatron.model.hf_files import SafetensorsDir
    from gspo_megatron.parallel.groups import Layout
    from gspo_megatron.parallel.launch import run_on_ranks
    from gspo_megatron.rollout.server import node_env
    from gspo_megatron.rollout.weight_sync import buckets

    work = tmp_path_factory.mktemp("qwen3_next")
    hf_dir = hf_tiny.save_variant("qwen3_next", work, seed=23)
    export_dir = work / "export"
    ((stream,),) = run_on_ranks(_convert_and_stream, 1, Layout(), [(str(hf_dir), str(work / "megatron"),
                                                                     str(export_dir))], timeout=300)
    files = SafetensorsDir(export_dir)
    loads = {"export": ["files"], "sync": list(buckets(stream, bucket_bytes=1))}
    torch.save(loads, work / "loads.pt")
    run = subprocess.run([sys.executable, "-m", "tests.rollout.sglang_load", str(export_dir), str(work / "loads.pt"),
                          str(work / "sglang.pt")], cwd=REPO, env=node_env("cpu"), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return dict(config=json.loads((export_dir / "config.json").read_text()), stream=dict(stream), buckets=loads["sync"],
                exported={name: files.read(name) for name in files.shapes()},
                sglang=torch.load(work / "sglang.pt", weights_only=False))


@pytest.mark.megatron  # converts and builds the Megatron policy
@pytest.mark.parametrize("source", ["export", "sync"])
def test_sglang_loads_every_qwen3_next_tensor_we_send(loaded, source):
    config, result = loaded["config"], loaded["sglang"]["loads"][source]
    named = loaded["exported"] if source == "export" else loaded["stream"]
    assert loaded["sglang"]["class"] == "Qwen3NextForCausalLM"
    assert config["full_attention_interval"] == 4
    assert source == "export" or len(loaded["buckets"]) == len(named)  # every tensor a call of its own
    expected, dropped = expected_params(named, config["num_hidden_layers"], config["num_experts"])
    assert bool(dropped) == (source == "export")  # the MTP layer: carried by the export, not in the policy
    assert_loaded_equal(result, expected, config["vocab_size"], source)
    print(f"qwen3_next {source}: {len(named) - len(dropped)} names -> {len(result['params'])} SGLang parameters, "
          f"max diff 0.0, {len(dropped)} MTP names dropped by design")


@pytest.mark.megatron
def test_the_sync_sends_the_exports_names(loaded):
    stream = loaded["stream"]
    exported = {n: t for n, t in loaded["exported"].items() if not n.startswith("mtp.")}
    assert sorted(stream) == sorted(exported) and all(torch.equal(stream[n], exported[n]) for n in exported)
