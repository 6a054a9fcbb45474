"""Our MiniMax-M2 tensors are what SGLang's ``MiniMaxM2ForCausalLM`` loads, checked against its own code, in-process
(``sglang_load``, as ``test_gpt_oss_sglang_names`` does): conversion's export (hf -> Megatron -> ``megatron_to_hf`` at
world 1, read by SGLang's safetensors iterator) and the weight sync's stream (``Bridge.export_to_sender``, one tensor
a bucket, one ``load_weights`` call each), each loaded into a model whose every parameter was first set to NaN. Every
SGLang parameter must be written whole and equal ours through its fusions: ``qkv_proj`` = [q; k; v], the experts'
``w13_weight`` = [w1; w3] stacked over experts, ``w2_weight`` = w2 stacked; the whole-projection ``q_norm`` / ``k_norm``
(its ``MiniMaxM2RMSNormTP``), the router ``gate`` and the fp32 routing bias as they are, the bias also being what its
top-k routes with. The export's config.json carries the fields SGLang's class reads and transformers' config drops
(``use_routing_bias``, ``use_qk_norm``, ``rotary_dim``, ...: without them it would build no bias and no q/k norm).
"""

from __future__ import annotations

import pytest
import torch

from .test_deepseek_sglang_names import assert_loaded_equal, export_and_load


def expected_params(named: dict[str, torch.Tensor], layers: int, experts: int) -> dict[str, torch.Tensor]:
    """SGLang's parameters as its ``load_weights`` builds them from our HF tensors; each of ours used once."""
    out, used = {}, set()

    def take(*names):
        used.update(names)
        return [named[n] for n in names]

    for i in range(layers):
        attn, moe = f"model.layers.{i}.self_attn", f"model.layers.{i}.block_sparse_moe"
        out[f"{attn}.qkv_proj.weight"] = torch.cat(take(*(f"{attn}.{p}_proj.weight" for p in "qkv")))
        out[f"{moe}.experts.w13_weight"] = torch.stack([torch.cat(take(f"{moe}.experts.{e}.w1.weight",
                                                                      f"{moe}.experts.{e}.w3.weight"))
                                                        for e in range(experts)])
        out[f"{moe}.experts.w2_weight"] = torch.stack(take(*(f"{moe}.experts.{e}.w2.weight" for e in range(experts))))
    out.update((name, tensor) for name, tensor in named.items() if name not in used)
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return export_and_load(tmp_path_factory.mktemp("minimax_m2"), "minimax_m2", seed=17)


@pytest.mark.megatron  # converts and builds the Megatron policy
@pytest.mark.parametrize("source", ["export", "sync"])
def test_sglang_loads_every_minimax_m2_tensor_we_send(loaded, source):
    config, result = loaded["config"], loaded["sglang"]["loads"][source]
    named = loaded["exported"] if source == "export" else loaded["stream"]
    assert loaded["sglang"]["class"] == "MiniMaxM2ForCausalLM"
    assert config["use_routing_bias"] and config["use_qk_norm"] and config["rotary_dim"] == config["head_dim"] // 2
    assert source == "export" or len(loaded["buckets"]) == len(named)  # every tensor a call of its own
    expected = expected_params(named, config["num_hidden_layers"], config["num_local_experts"])
    assert_loaded_equal(result, expected, config["vocab_size"], source)
    for i in range(config["num_hidden_layers"]):  # the bias its top-k routes with: ours, in fp32
        bias = named[f"model.layers.{i}.block_sparse_moe.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and torch.equal(result["routing_bias"][i], bias), i


@pytest.mark.megatron
def test_the_sync_sends_the_exports_names(loaded):
    stream, exported = loaded["stream"], loaded["exported"]
    assert sorted(stream) == sorted(exported) and all(torch.equal(stream[n], exported[n]) for n in exported)
