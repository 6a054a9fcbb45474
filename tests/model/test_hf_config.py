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


# The shape of GLM-4.5's (355B) hub config.json: partial_rotary_factor at the top level, no rope_parameters.
GLM_4_5 = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5, "intermediate_size": 12288,
    "max_position_embeddings": 131072, "moe_intermediate_size": 1536, "norm_topk_prob": True,
    "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_hidden_layers": 92,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_qk_norm": True,
    "vocab_size": 151552,
}


def test_glm_4_5_hub_config():
    spec = read_hf_config(GLM_4_5)
    assert spec.moe_layers == (False,) * 3 + (True,) * 89 and spec.num_experts == 160 and spec.moe_topk == 8
    assert (spec.moe_router, spec.moe_router_groups, spec.moe_router_group_topk) == ("sigmoid", 1, 1)
    assert spec.moe_scaling_factor == 2.5 and spec.moe_shared_ffn_hidden_size == 1536 and spec.norm_topk_prob
    assert spec.qkv_bias and spec.qk_norm and spec.rotary_percent == 0.5 and spec.head_dim == 128
    assert spec.mtp_layers == 1 and spec.rope_theta == 1e6
    assert not read_hf_config({**GLM_4_5, "use_qk_norm": False}).qk_norm  # GLM-4.5-Air has none
    check_layout(spec, Layout(tensor=8, expert=16, expert_tensor=1, pipeline=4, sequence_parallel=True), world_size=128)


def test_glm_tiny_variant_parses(hf_models):
    spec = read_hf_config(hf_models["glm4_moe"])  # transformers 5.19's save: the factor inside rope_parameters too
    assert spec.moe_layers == (False, True) and (spec.moe_router_groups, spec.moe_router_group_topk) == (4, 2)
    assert spec.rotary_percent == 0.5 and spec.qkv_bias and spec.qk_norm and spec.moe_shared_ffn_hidden_size == 16


@pytest.mark.parametrize("change, field", [
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"n_group": 8, "topk_group": 2}, "n_group=8, topk_group=2"),  # groups ranked by their top-4, HF by top-2
    ({"partial_rotary_factor": 0.5, "rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor=0.5 but rope_parameters.partial_rotary_factor=0.25"),
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
])
def test_unsupported_glm_configs_name_the_field(change, field):
    with pytest.raises(UnsupportedModel, match=re.escape(field)):
        read_hf_config({**GLM_4_5, **change})


def test_partial_rotary_is_refused_where_the_family_has_none():
    with pytest.raises(UnsupportedModel, match=re.escape("partial_rotary_factor=0.5 in config.json is not supported "
                                                         "for qwen3_moe")):
        read_hf_config({**QWEN3_30B_A3B, "partial_rotary_factor": 0.5})


# The shape of DeepSeek-V3's (671B) hub config.json: legacy rope_scaling with YaRN, FP8 quantization_config.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def test_deepseek_v3_and_kimi_k2_hub_configs():
    spec = read_hf_config(DEEPSEEK_V3)
    assert (spec.attention, spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.v_head_dim,
            spec.head_dim) == ("mla", 1536, 512, 64, 128, 192)
    assert (spec.yarn_factor, spec.yarn_original_max_position_embeddings, spec.yarn_mscale_all_dim) == (40.0, 4096, 1.0)
    assert spec.moe_layers == (False,) * 3 + (True,) * 58 and (spec.moe_router_groups, spec.moe_router_group_topk) == (8, 4)
    assert spec.moe_shared_ffn_hidden_size == 2048 and spec.mtp_layers == 1 and spec.padded_vocab_size() == 129280
    # Kimi-K2: model_type kimi_k2, the same architecture; 384 experts in one group, one dense layer, no MTP
    kimi = read_hf_config({**DEEPSEEK_V3, "model_type": "kimi_k2", "n_routed_experts": 384, "n_group": 1,
                           "topk_group": 1, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0,
                           "routed_scaling_factor": 2.827, "num_attention_heads": 64, "vocab_size": 163840})
    assert (kimi.family, kimi.num_experts, kimi.moe_router_groups, kimi.mtp_layers) == ("deepseek_v3", 384, 1, 0)
    # Moonlight: no q LoRA
    assert read_hf_config({**DEEPSEEK_V3, "q_lora_rank": None}).q_lora_rank == 0
    check_layout(spec, Layout(tensor=8, expert=64, expert_tensor=1, sequence_parallel=True), world_size=512,
                 transformer_engine=True)
    # 61 layers: no even split over 8 stages; the refusal names the fields, and uneven stages fit
    with pytest.raises(LayoutError, match="num_hidden_layers=61 is not divisible by pipeline_model_parallel_size=8: "
                                          ".*uneven stages \\(num_layers_in_first_pipeline_stage"):
        check_layout(spec, Layout(tensor=8, expert=64, expert_tensor=1, pipeline=8, sequence_parallel=True))
    uneven = Layout(tensor=8, expert=64, expert_tensor=1, pipeline=8, sequence_parallel=True, first_stage_layers=5)
    check_layout(spec, uneven, world_size=512, transformer_engine=True)  # 5 + 7 x 8
    assert uneven.stage_layers(61) == [5] + [8] * 7 and uneven.stage_range(61, 1) == range(5, 13)


def test_an_export_carries_the_fields_sglang_reads():
    """SGLang's DeepseekV2 reads moe_layer_freq, topk_method and scoring_func, which transformers' DeepseekV3Config
    does not define (a re-save drops them): an export fills them with DeepSeek-V3's values, keeps any present."""
    from gspo_megatron.model.hf_config import serving_config

    resaved = {k: v for k, v in DEEPSEEK_V3.items() if k not in ("moe_layer_freq", "topk_method", "scoring_func")}
    assert serving_config(resaved) == DEEPSEEK_V3
    assert serving_config(DEEPSEEK_V3) == DEEPSEEK_V3
    assert serving_config(QWEN3_30B_A3B) == QWEN3_30B_A3B


@pytest.mark.parametrize("first, last, pp, message", [
    (5, None, 8, None),  # 5 + 7 x 8
    (None, 5, 8, None),
    (13, 16, 4, None),  # 13 + 2 x 16 + 16
    (4, None, 8, "leaves 57 layers for the other 7 stage(s), which must split them evenly"),
    (30, 30, 2, "hold 60 layers but num_hidden_layers=61: with pipeline_model_parallel_size=2 they must add up"),
    (60, None, 4, "leaves 1 layers for the other 3 stage(s)"),
    (0, None, 4, "a stage needs at least one layer"),
    (5, None, 1, "uneven stages need pipeline > 1"),
])
def test_uneven_pipeline_stages(first, last, pp, message):
    """parallel.first_stage_layers / last_stage_layers (megatron's num_layers_in_first/last_pipeline_stage) on a
    61-layer model: the other stages split the rest evenly, each at least one layer, or the error says which."""
    spec = read_hf_config(DEEPSEEK_V3)
    layout = Layout(pipeline=pp, first_stage_layers=first, last_stage_layers=last)
    if message is None:
        check_layout(spec, layout, transformer_engine=True)
        stages = layout.stage_layers(61)
        assert sum(stages) == 61 and len(stages) == pp and min(stages) >= 1
        assert [layout.stage_range(61, i).start for i in range(pp)] == [sum(stages[:i]) for i in range(pp)]
    else:
        with pytest.raises(LayoutError) as error:
            check_layout(spec, layout, transformer_engine=True)
        assert message in str(error.value)


@pytest.mark.parametrize("change, field", [
    ({"rope_interleave": False}, "rope_interleave=False"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"rope_scaling": {"type": "yarn", "factor": 40, "attention_factor": 0.5}}, "attention_factor"),
    ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, "rope_type='longrope'"),
])
def test_unsupported_deepseek_configs_name_the_field(change, field):
    with pytest.raises(UnsupportedModel, match=re.escape(field)):
        read_hf_config({**DEEPSEEK_V3, **change})


def test_plan_parameter_counts_equal_the_checkpoints(hf_models):
    """``plan.memory.model_parameters`` (what ``plan`` sizes weights and optimizer state from) counts exactly the
    tensors the mapping reads, for every family (MLA, shared experts, router bias included; MTP layers not built)."""
    import math

    from gspo_megatron.model import mapping
    from gspo_megatron.plan.memory import model_parameters

    for name, path in hf_models.items():
        spec = read_hf_config(path)
        assert model_parameters(spec)[0] == sum(math.prod(s) for s in mapping.hf_tensor_shapes(spec).values()), name
    # The model cards: DeepSeek-V3 671B total, 37B active; GLM-4.5 355B with its MTP layer (~2.5B), 32B active
    # without the embedding and output layer (1.55B)
    total, active = model_parameters(read_hf_config(DEEPSEEK_V3))
    assert 670e9 < total < 672e9 and 37e9 < active < 38e9
    total, active = model_parameters(read_hf_config(GLM_4_5))
    assert 352e9 < total < 355e9 and 32e9 < active - 2 * 151552 * 5120 < 32.5e9
