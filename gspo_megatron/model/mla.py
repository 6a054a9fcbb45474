"""DeepSeek-V3's multi-latent attention on megatron-core's local layer spec: the core attention it lacks.

megatron-core builds MLA's core attention with separate key and value head sizes (``k_channels`` = nope + rope,
``v_channels`` = v head dim). Only TransformerEngine's attention takes them: the local ``DotProductAttention`` (0.16
and 0.19) has no such arguments. ``LocalMLAAttention`` is that core attention written out for the local spec
(CPU, tests): softmax(q k^T * softmax_scale + mask) v in fp32, per head, causal unless a mask is given (megatron's
convention: True where masked, [b, 1, sq, sk], as the packed-sequence path passes). ``mla_spec`` puts it into a
decoder block spec built with the local spec, and drops the q latent norm where there is no q LoRA (0.19 refuses a
norm it would not use; 0.16 builds none) and, on 0.19 without q LoRA, keeps ``linear_q_proj`` a plain linear under
either spec (``MLASelfAttentionWithoutQNorm``), and with ``mla_down_proj_fusion`` gives the local spec megatron's
fused down projection, which only megatron's TE spec builds (``down_proj_fusion_problem`` says where it cannot).
Shapes: q, k [s, b, heads/TP, nope + rope], v [s, b, heads/TP, v]; out [s, b, heads/TP * v].
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


class LocalMLAAttention(MegatronModule):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("LocalMLAAttention has no context parallelism: it needs TransformerEngine's attention")
        self.softmax_scale = softmax_scale if softmax_scale is not None else (k_channels or config.kv_channels) ** -0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("LocalMLAAttention takes a mask, not packed_seq_params or attention_bias")
        scores = torch.einsum("sbhd,tbhd->bhst", query.float(), key.float()) * self.softmax_scale
        if attention_mask is None:
            sq, sk = scores.shape[-2:]
            attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(sk - sq + 1)
        probs = torch.softmax(scores.masked_fill(attention_mask, float("-inf")), dim=-1)
        context = torch.einsum("bhst,tbhd->sbhd", probs, value.float()).to(value.dtype)
        return context.reshape(context.shape[0], context.shape[1], -1)


class MLASelfAttentionWithoutQNorm(MLASelfAttention):
    """MLA without q LoRA (Moonlight, DeepSeek-V2-Lite) as HF's DeepSeek-V3 computes it: ``q_proj`` reads the input
    norm's output, with no norm of its own.

    megatron-core 0.19's ``mla_qk_norm_config.QKNormConfigResolver`` builds ``linear_q_proj``, under
    ``qk_layernorm`` (which the kv latent norm needs) and without q LoRA, as the backend's fused norm+linear: TE's
    ``TELayerNormColumnParallelLinear``, whose ``layer_norm_weight`` is a second RMSNorm over the already normalised
    input. The input norm is not fused there: TE's MLA spec keeps it as the layer's ``input_layernorm`` (it feeds
    ``linear_kv_down_proj`` too). HF has no such norm, and no weight makes it one: it divides each token by the RMS of
    ``input_layernorm``'s output, which is not 1. So that norm is not built: this resolver keeps the spec's plain
    column-parallel ``linear_q_proj`` (TE's ``TEColumnParallelLinear``, ``linear_q_proj.weight``; the local spec's
    ``ColumnParallelLinear``), as megatron-core 0.16.1 builds it. Only for versions with the resolver (0.19)."""

    def _resolve_qk_norm_config(self, submodules):
        from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

        class KeepPlainQProj(QKNormConfigResolver):
            def _mla_fused_linear_or_default(self, module_spec, module_name):
                if module_name == "linear_q_proj" and module_spec is not None:
                    return module_spec
                return super()._mla_fused_linear_or_default(module_spec, module_name)

        return KeepPlainQProj(self.config, submodules).resolve()


def megatron_has_down_proj_fusion() -> bool:
    from megatron.core.transformer import MLATransformerConfig

    return "mla_down_proj_fusion" in {field.name for field in dataclasses.fields(MLATransformerConfig)}


def down_proj_fusion_problem(spec) -> str | None:
    """Why ``model.mla_down_proj_fusion=true`` cannot build ``spec`` (a ``ModelSpec``) here, else None."""
    from importlib.metadata import version

    if spec.attention != "mla":
        return (f"model.mla_down_proj_fusion=true fuses multi-latent attention's down projections, and "
                f"{spec.family} has none: set model.mla_down_proj_fusion=false")
    if not megatron_has_down_proj_fusion():
        return (f"model.mla_down_proj_fusion=true needs a megatron-core whose MLATransformerConfig has "
                f"mla_down_proj_fusion (0.19.2 has it); this is megatron-core {version('megatron-core')}: "
                "set model.mla_down_proj_fusion=false")
    if not spec.q_lora_rank:
        return ("model.mla_down_proj_fusion=true fuses q_a_proj with kv_a_proj_with_mqa, and this model has no q "
                "LoRA (q_lora_rank null, as Moonlight): megatron's FusedMLASelfAttention requires one; set "
                "model.mla_down_proj_fusion=false")
    return None


def mla_spec(block, local: bool, q_lora: bool, down_proj_fusion: bool = False):
    """``block`` with ``LocalMLAAttention`` in its MLA layers (``local``: built with megatron's local spec) and
    without a q latent norm unless ``q_lora``. ``down_proj_fusion`` on the local spec: megatron's
    ``FusedMLASelfAttention`` with the local spec's down-projection class (column-parallel) as
    ``linear_qkv_down_proj``, the input norm kept separate (megatron's TE spec builds the fused layer itself, with
    the norm fused in; its local spec ignores the flag)."""
    from megatron.core.transformer.identity_op import IdentityOp

    def with_core(layer):
        attention = layer.submodules.self_attention
        changes = {"core_attention": LocalMLAAttention} if local else {}
        if not q_lora:
            changes["q_layernorm"] = IdentityOp
            if hasattr(MLASelfAttention, "_resolve_qk_norm_config"):  # 0.19: see MLASelfAttentionWithoutQNorm
                attention = dataclasses.replace(attention, module=MLASelfAttentionWithoutQNorm)
        if local and down_proj_fusion:
            from megatron.core.transformer.multi_latent_attention import FusedMLASelfAttention

            changes.update(linear_qkv_down_proj=attention.submodules.linear_kv_down_proj, linear_q_down_proj=None,
                           linear_kv_down_proj=None)
            attention = dataclasses.replace(attention, module=FusedMLASelfAttention)
        submodules = dataclasses.replace(attention.submodules, **changes)
        attention = dataclasses.replace(attention, submodules=submodules)
        return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention))

    return dataclasses.replace(block, layer_specs=[with_core(s) for s in block.layer_specs])
