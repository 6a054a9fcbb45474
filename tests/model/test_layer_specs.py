"""The layer specs the provider builds: a MoE layer's pre-MLP norm keeps its own checkpoint name on megatron's
local spec (as TransformerEngine's spec names it), so a checkpoint written on CPU loads into a TE model; dense
layers keep megatron's fused-norm key. megatron-core 0.16 describes MoE layers as ModuleSpecs, 0.19 as builder
partials: both legs of the suite run this. MLA under megatron-core 0.19's TE spec (built without TE, never run):
every attention name it gives is one the mapping places, with and without q LoRA and with ``mla_down_proj_fusion``."""

from __future__ import annotations

import pytest

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from tests.model import hf_tiny


def _keys_maps(hf_dir: str) -> list[dict]:
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.process_groups import ensure_model_parallel
    from gspo_megatron.model.provider import decoder_block_spec, transformer_config

    ensure_model_parallel(Layout())
    spec = read_hf_config(f"{hf_dir}/config.json")
    block = decoder_block_spec(transformer_config(spec, Layout()), use_te=False)
    return [dict(s.submodules.sharded_state_dict_keys_map) for s in block.layer_specs]


def test_moe_norm_keeps_its_name_on_the_local_spec(tmp_path):
    hf_dir = hf_tiny.save_variant("qwen3_moe", tmp_path)  # layer 0 MoE, layer 1 dense (mlp_only_layers=[1])
    (maps,) = run_on_ranks(_keys_maps, 1, Layout(), str(hf_dir))
    moe, dense = maps
    assert "pre_mlp_layernorm." not in moe, moe
    assert dense.get("pre_mlp_layernorm.") == "mlp.linear_fc1.layer_norm_", dense


# ---- multi-latent attention under TransformerEngine's spec, without TE -------------------------------------------
# megatron's TE spec cannot be built here (``gpt_layer_specs.TESpecProvider`` is None without TE), but its
# provider class imports, with TE's classes as stand-in objects: enough to build the *spec* (never a module) and
# run megatron's own q/kv norm resolver on it. TE's parameter names per class: a linear's ``weight``, plus
# ``layer_norm_weight`` where the norm is fused in (``TELayerNormColumnParallelLinear``); a norm's ``weight``.
# TE itself never runs here.


def _te_attention_names(hf_dir: str, fusion: bool) -> dict:
    from unittest import mock

    from megatron.core.extensions import transformer_engine_spec_provider as te_provider
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

    from gspo_megatron.model import mapping
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.process_groups import ensure_model_parallel
    from gspo_megatron.model.provider import decoder_block_spec, transformer_config

    ensure_model_parallel(Layout())
    spec = read_hf_config(f"{hf_dir}/config.json")
    config = transformer_config(spec, Layout(), mla_down_proj_fusion=fusion)
    te = te_provider.TESpecProvider()
    norm_linear = te.column_parallel_layer_norm_linear()
    with mock.patch.object(gpt_layer_specs, "TESpecProvider", te_provider.TESpecProvider), \
            mock.patch.object(gpt_layer_specs, "TENorm", te.layer_norm(rms_norm=True)):
        layer = decoder_block_spec(config, use_te=True).layer_specs[0]
    attention = layer.submodules.self_attention
    module, submodules = attention.module, attention.submodules
    own = type("Resolving", (), {"config": config})()
    resolved = module._resolve_qk_norm_config(own, submodules)  # what the attention will build
    megatrons = QKNormConfigResolver(config, submodules).resolve()  # what megatron's MLASelfAttention would

    def params(name, cls):
        if cls is None or cls is IdentityOp:
            return []
        fused = [f"{name}.layer_norm_weight"] if cls is norm_linear else []
        return fused + [f"{name}.weight"]

    linears = {"linear_q_proj": resolved["linear_q_proj"], "linear_q_up_proj": resolved["linear_q_up_proj"],
               "linear_kv_up_proj": resolved["linear_kv_up_proj"], "linear_proj": submodules.linear_proj}
    if spec.q_lora_rank and not fusion:
        linears["linear_q_down_proj"] = submodules.linear_q_down_proj
    linears.update({"linear_qkv_down_proj": submodules.linear_qkv_down_proj} if fusion
                   else {"linear_kv_down_proj": submodules.linear_kv_down_proj})
    names = [n for key, cls in linears.items() for n in params(f"self_attention.{key}", cls)]
    names += params("self_attention.q_layernorm", resolved["q_layernorm"])
    names += params("self_attention.kv_layernorm", resolved["kv_layernorm"])
    names += [] if layer.submodules.input_layernorm is IdentityOp else ["input_layernorm.weight"]
    mapped = {}
    for rule in mapping.rules_for(spec, fusion):
        for pattern in (rule.megatron, rule.te_name):
            if pattern and pattern.startswith("decoder.layers.{layer}.") and rule.scope == mapping.LAYER:
                mapped[pattern.format(layer=0).removeprefix("decoder.layers.0.")] = [p.name for p in rule.hf]
    return {"module": module.__name__, "names": sorted(names), "mapped": mapped,
            "megatron_q_proj_fuses_a_norm": megatrons["linear_q_proj"] is norm_linear,
            "q_proj_fuses_a_norm": resolved["linear_q_proj"] is norm_linear,
            "input_layernorm": getattr(layer.submodules.input_layernorm, "__name__", "TENorm"),
            "keys_map": dict(layer.submodules.sharded_state_dict_keys_map)}


def _te_attention_cases(moonlight: str, deepseek: str) -> dict:
    out = {"moonlight": _te_attention_names(moonlight, False), "deepseek_v3": _te_attention_names(deepseek, False)}
    from gspo_megatron.model.mla import megatron_has_down_proj_fusion

    if megatron_has_down_proj_fusion():
        out["deepseek_v3_fused"] = _te_attention_names(deepseek, True)
    return out


@pytest.mark.megatron  # builds megatron-core 0.19's TE layer specs (0.16.1 builds MLA's q_proj plain itself)
def test_mla_under_te_specs_has_only_mapped_names(hf_models):
    """Every attention parameter name megatron's TE spec gives MLA layers is one the mapping places, and HF's
    tensors behind each: without q LoRA, 0.19 would fuse a second norm into ``linear_q_proj`` (unmappable: HF has
    none), which ``MLASelfAttentionWithoutQNorm`` does not build; with ``mla_down_proj_fusion``, HF's input norm is
    ``linear_qkv_down_proj.layer_norm_weight`` (TE fuses it there; the layer's ``input_layernorm`` is an identity)."""
    from gspo_megatron.model.mla import megatron_has_down_proj_fusion

    if not megatron_has_down_proj_fusion():
        pytest.skip("megatron-core 0.16.1 has neither the q-norm resolver nor the fused down projection")
    (cases,) = run_on_ranks(_te_attention_cases, 1, Layout(), str(hf_models["moonlight"]),
                            str(hf_models["deepseek_v3"]))
    for name, case in cases.items():
        unmapped = [n for n in case["names"] if n not in case["mapped"]]
        assert not unmapped, f"{name}: TE names without a rule: {unmapped}"
    moonlight = cases["moonlight"]
    assert moonlight["megatron_q_proj_fuses_a_norm"] and not moonlight["q_proj_fuses_a_norm"], moonlight
    assert moonlight["module"] == "MLASelfAttentionWithoutQNorm"
    assert "self_attention.linear_q_proj.weight" in moonlight["names"], moonlight["names"]
    assert moonlight["mapped"]["input_layernorm.weight"] == ["model.layers.{layer}.input_layernorm.weight"]
    unfused = cases["deepseek_v3"]
    assert unfused["module"] == "MLASelfAttention" and "self_attention.linear_q_up_proj.layer_norm_weight" in \
        unfused["names"], unfused
    fused = cases["deepseek_v3_fused"]
    assert fused["module"] == "FusedMLASelfAttention" and fused["input_layernorm"] == "IdentityOp", fused
    assert "input_layernorm.weight" not in fused["names"], fused["names"]
    assert fused["mapped"]["self_attention.linear_qkv_down_proj.layer_norm_weight"] == [
        "model.layers.{layer}.input_layernorm.weight"]
    assert fused["mapped"]["self_attention.linear_qkv_down_proj.weight"] == [
        "model.layers.{layer}.self_attn.q_a_proj.weight", "model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"]
    # megatron's dist checkpoint keeps the fused norm under the layer's input_layernorm key
    assert fused["keys_map"]["self_attention.linear_qkv_down_proj.layer_norm_"] == "input_layernorm.", fused["keys_map"]
