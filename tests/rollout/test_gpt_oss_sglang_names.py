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

import pytest
import torch

from .test_deepseek_sglang_names import assert_loaded_equal, export_and_load


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
    return export_and_load(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", seed=13)


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
