"""Our gpt-oss tensors are what SGLang's ``GptOssForCausalLM`` loads, checked against its own code. SGLang serves
gpt-oss only with attention backends that have sliding windows and sinks (triton, fa3, trtllm_mha, intel_amx, ...):
it refuses the CPU server's ``torch_native`` by name ("GptOssForCausalLM requires one of [...] attention backend"),
and ``intel_amx`` needs an AMX CPU with sgl-kernel (absent here: SGLang falls back to torch_native). So no server
runs: ``sglang_load`` builds SGLang's model class in a process of its own and feeds its real ``load_weights``, as
``test_deepseek_sglang_names`` does for DeepSeek-V3.

Two sources, each loaded into a model whose every parameter was first set to NaN: ``export`` (conversion's output,
hf -> Megatron -> ``megatron_to_hf`` at world 1, read by SGLang's safetensors iterator in one call) and ``sync`` (the
weight sync's stream, ``Bridge.export_to_sender``, one tensor a bucket, one ``load_weights`` call each). Every
SGLang parameter must be written whole and equal our tensors through its fusions: ``qkv_proj`` = [q; k; v] (weight
and bias), the experts' ``w13_weight`` = ``gate_up_proj`` transposed (gate and up still interleaved: SGLang's kernel
reads them so), ``w2_weight`` = ``down_proj`` transposed, the biases as stacked. SGLang holds the sinks in bf16 (its
``GptOssAttention`` creates them so whatever the dtype): they equal ours rounded to bf16, a difference of up to
2^-9 relative in a logit that joins every softmax (the one inexact parameter; fp32 elsewhere).
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


def expected_params(named: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """SGLang's parameters as its ``load_weights`` builds them from our HF tensors; each of ours used once."""
    out, used = {}, set()

    def take(*names):
        used.update(names)
        return [named[n] for n in names]

    for i in range(layers):
        attn, experts = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp.experts"
        for kind in ("weight", "bias"):
            out[f"{attn}.qkv_proj.{kind}"] = torch.cat(take(*(f"{attn}.{p}_proj.{kind}" for p in "qkv")))
        out[f"{attn}.sinks"] = take(f"{attn}.sinks")[0].to(torch.bfloat16)
        out[f"{experts}.w13_weight"] = take(f"{experts}.gate_up_proj")[0].transpose(1, 2)
        out[f"{experts}.w2_weight"] = take(f"{experts}.down_proj")[0].transpose(1, 2)
        out[f"{experts}.w13_weight_bias"], = take(f"{experts}.gate_up_proj_bias")
        out[f"{experts}.w2_weight_bias"], = take(f"{experts}.down_proj_bias")
    out.update((name, tensor) for name, tensor in named.items() if name not in used)
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    require_sglang()
    from gspo_megatron.model.hf_files import SafetensorsDir
    from gspo_megatron.parallel.groups import Layout
    from gspo_megatron.parallel.launch import run_on_ranks
    from gspo_megatron.rollout.server import node_env
    from gspo_megatron.rollout.weight_sync import buckets

    work = tmp_path_factory.mktemp("gpt_oss")
    hf_dir = hf_tiny.save_variant("gpt_oss", work, seed=13)
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
def test_sglang_loads_every_gpt_oss_tensor_we_send(loaded, source):
    config, result = loaded["config"], loaded["sglang"]["loads"][source]
    named = loaded["exported"] if source == "export" else loaded["stream"]
    assert loaded["sglang"]["class"] == "GptOssForCausalLM"
    assert source == "export" or len(loaded["buckets"]) == len(named)  # every tensor a call of its own
    assert_loaded_equal(result, expected_params(named, config["num_hidden_layers"]), config["vocab_size"], source)
    sinks = [named[n] for n in named if n.endswith("sinks")]
    assert sinks and any(not torch.equal(s, s.bfloat16().float()) for s in sinks)  # the rounding is real


@pytest.mark.megatron
def test_the_sync_sends_the_exports_names(loaded):
    stream, exported = loaded["stream"], loaded["exported"]
    assert sorted(stream) == sorted(exported) and all(torch.equal(stream[n], exported[n]) for n in exported)
