"""HF config.json -> ModelSpec, and layout checks: pure functions, no process groups."""

from __future__ import annotations

import re

import pytest

from gspo_megatron.model.errors import LayoutError, UnsupportedModel
from gspo_megatron.model.hf_config import read_hf_config
from gspo_megatron.model.layout_check import check_layout, minimal_world_size
from gspo_megatron.parallel.groups import Layout

# The shape of Qwen3-30B-A3B's hub config.json (hub spelling: num_experts, legacy rope_theta).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": None, "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu",
    "attention_bias": False, "use_sliding_window": False, "torch_dtype": "bfloat16",
}


def test_tiny_variants_parse(hf_models):
    specs = {name: read_hf_config(path) for name, path in hf_models.items()}
    moe = specs["qwen3_moe"]
    assert (moe.family, moe.moe_layers, moe.num_experts, moe.moe_topk) == ("qwen3_moe", (True, False), 4, 2)
    assert moe.norm_topk_prob
    assert moe.head_dim == 16 and moe.hidden_size // moe.num_attention_heads == 8  # head_dim != hidden / heads
    step2 = specs["qwen3_moe_step2"]
    assert step2.moe_layers == (False, True) and not step2.norm_topk_prob and step2.tie_embeddings
    assert step2.padded_vocab_size() == 128 and step2.vocab_size == 100
    assert specs["qwen3"].qk_norm and specs["qwen3"].rope_theta == 1e6
    assert specs["qwen2"].qkv_bias and not specs["qwen2"].qk_norm
    assert specs["llama"].rope_scaling_factor == 8.0 and specs["llama"].rope_theta == 500000.0


def test_hub_config_with_legacy_rope_fields():
    spec = read_hf_config(QWEN3_30B_A3B)
    assert spec.num_experts == 128 and spec.rope_theta == 1e6 and spec.moe_layers == (True,) * 48
    assert spec.padded_vocab_size() == 151936  # already a multiple of 128: no padding rows
    check_layout(spec, Layout(tensor=4, expert=8, pipeline=2, sequence_parallel=True), world_size=64)


@pytest.mark.parametrize("change, field", [
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, "model_type='mixtral'"),
    ({"architectures": ["Qwen3MoeForSequenceClassification"]}, "architectures="),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
])
def test_unsupported_configs_name_the_field(change, field):
    with pytest.raises(UnsupportedModel, match=re.escape(field)):
        read_hf_config({**QWEN3_30B_A3B, **change})


def test_llama_bias_and_rope_constants_are_checked():
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_act": "silu"}
    assert read_hf_config(llama).num_key_value_heads == 4
    with pytest.raises(UnsupportedModel, match="mlp_bias=True"):
        read_hf_config({**llama, "mlp_bias": True})
    bad_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "rope_theta": 5e5}
    with pytest.raises(UnsupportedModel, match="low_freq_factor=2.0"):
        read_hf_config({**llama, "rope_parameters": bad_rope})


@pytest.mark.parametrize("config_change, layout, message", [
    ({"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64}, Layout(tensor=4, sequence_parallel=True),
     "num_attention_heads=6 is not divisible by tensor_model_parallel_size=4: use a tensor_model_parallel_size that "
     "divides 6 (1, 2, 3 or 6)"),
    ({}, Layout(tensor=8, sequence_parallel=True),
     "num_key_value_heads=4 is not divisible by tensor_model_parallel_size=8"),
    ({}, Layout(expert=5), "num_experts=128 is not divisible by expert_model_parallel_size=5"),
    ({}, Layout(pipeline=5), "num_hidden_layers=48 is not divisible by pipeline_model_parallel_size=5"),
    ({}, Layout(tensor=2), "sequence_parallel=False with tensor_model_parallel_size=2 on a MoE model"),
    ({}, Layout(expert=2, expert_tensor=5),
     "moe_intermediate_size=768 is not divisible by expert_tensor_parallel_size=5"),
    ({}, Layout(context=2), "context_parallel_size=2 needs TransformerEngine's attention"),
])
def test_layout_errors_name_field_and_fix(config_change, layout, message):
    spec = read_hf_config({**QWEN3_30B_A3B, **config_change})
    with pytest.raises(LayoutError) as error:
        check_layout(spec, layout, transformer_engine=False)
    assert message in str(error.value)


def test_layout_errors_for_dense_models_and_world_size():
    dense = read_hf_config({**QWEN3_30B_A3B, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                            "intermediate_size": 6008})
    with pytest.raises(LayoutError) as error:
        check_layout(dense, Layout(tensor=16, expert=2), world_size=24)
    text = str(error.value)
    assert "expert_model_parallel_size=2 but qwen3 has no experts: use 1" in text
    assert "intermediate_size=6008 is not divisible by tensor_model_parallel_size=16" in text
    assert "world size 24 is not divisible by tensor*pipeline*context = 16" in text
    # Experts are split over expert_tensor (default: tensor) x expert ranks, dense layers over tensor ranks.
    assert minimal_world_size(Layout(tensor=2, expert=4)) == 8
    assert minimal_world_size(Layout(tensor=2, expert=4, expert_tensor=1)) == 4
    assert minimal_world_size(Layout(tensor=2, pipeline=2, expert=3)) == 12
