"""MiniMax-M2 (``model.minimax_m2``): what the tiny model exercises, its config reading, FP8 block checkpoints.

The logits, export, conversion and score checks under every layout run in the shared launch
(tests/model/test_bridge.py, tests/tools/test_convert.py, tests/tools/test_score.py: ``hf_tiny.VARIANTS["minimax_m2"]``;
its q/k norm weights split over TP there). Here: (1) transformers-only controls that the tiny model's whole-projection
q/k norm (against a per-head one with the same weights) and its routing bias each move its logits by far more than the
1e-4 those checks allow; (2) the released config.json's fields read, and the ones we do not map refused by name;
(3) an FP8 block checkpoint (quantized here as MiniMax-M2's release is: float8_e4m3fn linear weights with a
``weight_scale_inv`` per block, ``fmt: float8_e4m3fn``; router, its bias, norms, embeddings and lm_head unquantized)
reads dequantized, converts to Megatron and back to the dequantized tensors bit for bit, and scores as transformers on
the dequantized twin (fp32, 1e-4).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gspo_megatron.model.errors import UnsupportedModel
from gspo_megatron.model.hf_config import read_hf_config, serving_config
from gspo_megatron.model.hf_files import SafetensorsDir, open_hf_dir
from gspo_megatron.parallel.groups import Layout
from tests.model import hf_tiny, rank_checks

MATTERS = 1e-2  # a feature the tiny model exercises moves its logits by more than this
BLOCK = (16, 12)  # partial edge blocks on the tiny shapes (32 x 32, 64 x 32, 16 x 32, 32 x 16)

# MiniMaxAI/MiniMax-M2's config.json (the fields that matter here; sizes as released)
RELEASE = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "attn_type_list": [1] * 62,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536,
    "max_position_embeddings": 196608, "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62,
    "num_key_value_heads": 8, "num_local_experts": 256, "num_mtp_modules": 3, "mtp_transformer_layers": 1,
    "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64,
    "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False, "use_mtp": True,
    "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                            "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
}


@torch.no_grad()
def test_tiny_minimax_exercises_its_whole_projection_norm_and_routing_bias(hf_models):
    model = hf_tiny.load_hf_model(hf_models["minimax_m2"])
    tokens = hf_tiny.input_tokens(model.config.vocab_size)
    reference = model(tokens).logits
    attention = model.model.layers[0].self_attn
    assert attention.q_norm.weight.shape == (model.config.num_attention_heads * model.config.head_dim,)

    def per_head(norm):
        def forward(x):  # the same weight, each head's mean of squares (megatron's qk_layernorm)
            heads = x.float().unflatten(-1, (-1, model.config.head_dim))
            normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            return norm.weight * normed.flatten(-2).to(x.dtype)
        return forward

    for layer in model.model.layers:
        layer.self_attn.q_norm.forward = per_head(layer.self_attn.q_norm)
        layer.self_attn.k_norm.forward = per_head(layer.self_attn.k_norm)
    assert (model(tokens).logits - reference).abs().max() > MATTERS, "the whole-projection norm"
    model = hf_tiny.load_hf_model(hf_models["minimax_m2"])
    for layer in model.model.layers:
        assert layer.mlp.e_score_correction_bias.abs().max() > 0
        layer.mlp.e_score_correction_bias.zero_()
    assert (model(tokens).logits - reference).abs().max() > MATTERS, "the routing bias"


def test_the_release_config_reads_and_unmapped_fields_are_refused_by_name():
    spec = read_hf_config(RELEASE)
    assert spec.qk_norm and spec.qk_norm_whole_projection and spec.rotary_percent == 0.5
    assert spec.moe_router == "sigmoid" and spec.moe_router_groups == 1 and spec.moe_scaling_factor == 1.0
    assert spec.norm_topk_prob and spec.moe_ffn_hidden_size == 1536 and spec.num_experts == 256
    assert all(spec.moe_layers) and spec.moe_shared_ffn_hidden_size == 0 and spec.mtp_layers == 3
    assert spec.rope_theta == 5e6 and spec.head_dim == 128
    for change, field in ((dict(attn_type_list=[0] + [1] * 61), "attn_type_list"),
                          (dict(scoring_func="softmax"), "scoring_func"), (dict(use_routing_bias=False), "use_routing_bias"),
                          (dict(qk_norm_type="per_head"), "qk_norm_type"), (dict(use_qk_norm=False), "use_qk_norm"),
                          (dict(shared_intermediate_size=1536), "shared_intermediate_size")):
        with pytest.raises(UnsupportedModel, match=field):
            read_hf_config({**RELEASE, **change})


def test_exports_carry_the_fields_sglang_reads(hf_models):
    """transformers' MiniMaxM2Config drops scoring_func, use_routing_bias, use_qk_norm and qk_norm_type; SGLang's
    MiniMaxM2 defaults the last three to off: an exported config says them."""
    config = json.loads((hf_models["minimax_m2"] / "config.json").read_text())
    assert "use_routing_bias" not in config
    served = serving_config(config)
    assert served["scoring_func"] == "sigmoid" and served["use_routing_bias"] and served["use_qk_norm"]
    assert served["qk_norm_type"] == "per_layer"
    assert served["rotary_dim"] == config["head_dim"] // 2  # SGLang reads rotary_dim (default: the whole head)


# ---- FP8 block checkpoints ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_models(hf_models, tmp_path_factory):
    """(FP8 directory, its dequantized fp32 twin): the linear weights of attention and experts block-FP8."""
    from safetensors.torch import load_file, save_file

    from gspo_megatron.model.fp8 import dequantize, quantize_reference

    source = hf_models["minimax_m2"]
    work = tmp_path_factory.mktemp("minimax_fp8")
    quantized, twin = work / "fp8", work / "dequantized"
    for target in (quantized, twin):
        shutil.copytree(source, target)
    tensors, plain = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
            fp8, scale = quantize_reference(tensor, BLOCK)
            tensors[name], tensors[name + "_scale_inv"] = fp8, scale
            plain[name] = dequantize(fp8, scale, BLOCK)
        else:
            tensors[name] = plain[name] = tensor
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, twin / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {**RELEASE["quantization_config"], "weight_block_size": list(BLOCK)}
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, twin


def test_fp8_weights_read_dequantized(fp8_models, hf_models):
    quantized, twin = fp8_models
    raw, source, plain = SafetensorsDir(quantized), open_hf_dir(quantized), SafetensorsDir(twin)
    assert sum(d == torch.float8_e4m3fn for d in raw.dtypes().values()) == 2 * (4 + 3 * 4)
    assert source.shapes() == plain.shapes() and source.dtypes() == plain.dtypes()
    for name in source.shapes():
        assert hf_tiny.same_bits(source.read(name), plain.read(name)), name
    name = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    original = SafetensorsDir(hf_models["minimax_m2"]).read(name)
    error = (source.read(name) - original).abs().max() / original.abs().max()
    assert 0 < error < 0.1, f"the quantization is not a quantization of the model ({error:.3f})"


@pytest.mark.megatron
def test_fp8_checkpoint_converts_and_scores_as_transformers_on_its_dequantized_twin(fp8_models, tmp_path):
    from gspo_megatron.parallel.launch import run_on_ranks
    from tests.model.rank_checks import score_records_for_tests
    from tests.tools.test_score import assert_agrees, transformers_loglik

    quantized, twin = fp8_models
    back = tmp_path / "back"
    (scores,) = run_on_ranks(rank_checks.quantized_round_trip_case, 1, Layout(), str(quantized), str(tmp_path / "megatron"), str(back),
                             timeout=300)
    rank_checks.assert_export_is_dequantized_twin(back, twin)
    assert_agrees(scores, transformers_loglik(twin, score_records_for_tests(read_hf_config(twin).vocab_size)))
