"""The gated-DeltaNet hybrids (Qwen3-Next, Qwen3.5 dense and MoE) on megatron-core's layer specs.

megatron-core builds a hybrid's GatedDeltaNet layers only through its TransformerEngine spec
(``experimental_attention_variant_module_specs._get_backend_spec_provider`` asserts TE). ``hybrid_spec`` puts them
into the decoder block spec we build either way: each linear-attention layer's ``self_attention`` becomes megatron's
``GatedDeltaNet`` with the backend's column-parallel ``in_proj``, the plain gated output norm and the row-parallel
``out_proj``; the other layers keep their (gated, ``attention_output_gate``) full attention.

Norms: every RMSNorm of these models but the DeltaNet's own is zero-centred (the checkpoint stores w, the norm applies
1 + w, in fp32: transformers' ``Qwen3_5MoeRMSNorm``): megatron's ``layernorm_zero_centered_gamma``, which TE's norms
implement and the local spec's ``WrappedTorchNorm`` refuses, so on the local spec they are ``ZeroCenteredRMSNorm``.
The DeltaNet's gated output norm applies w itself (``Qwen3_5MoeRMSNormGated``, weight initialised to 1), under
either spec: ``PlainRMSNorm`` (the config's zero-centred flag would otherwise apply to it too). Keeping both as
the checkpoint stores them makes conversion a copy, bit for bit.

Packed sequences (``parallel.pack_sequences``): each sequence of a packed row runs through the DeltaNet from a fresh
recurrent and convolution state (``PackedGatedDeltaNet``), whether the row's segments come as TransformerEngine's
THD ``packed_seq_params`` or as the local attention's block-diagonal mask (``packing.mask_segments``).

Shapes: hidden states [s, b, h]; the DeltaNet's in_proj [q_r; k_r; v_r; z_r; b_r; a_r] per TP rank (``mapping``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from gspo_megatron.parallel import packing


def transformer_config_fields(spec) -> dict:
    """``TransformerConfig`` fields of a gated-DeltaNet hybrid ``spec`` (a ``ModelSpec``)."""
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(linear) for linear in spec.linear_attention_layers],  # 1: DeltaNet, 0: attention
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        attention_output_gate=spec.attention_output_gate,
        layernorm_zero_centered_gamma=spec.zero_centered_norm,
    )


class _RMSNorm(torch.nn.Module):
    """RMSNorm over the last dim in fp32, scaled by ``offset + w`` (transformers' Qwen3.5 norms)."""

    offset = 0.0

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), 1.0 - self.offset, dtype=config.params_dtype))
        # elementwise over the hidden dim: a sequence-parallel shard normalises as the whole sequence; its grads
        # are all-reduced over TP by finalize_model_grads where tagged so (as TE's norms are)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (self.offset + self.weight.float())).to(x.dtype)


class ZeroCenteredRMSNorm(_RMSNorm):
    """Applies 1 + w (megatron's ``layernorm_zero_centered_gamma``) for the local spec."""

    offset = 1.0


class PlainRMSNorm(_RMSNorm):
    """Applies w: the DeltaNet's gated output norm, whatever the config's zero-centred flag."""


def _row_segments(attention_mask, packed_seq_params):
    """A packed row's segment offsets: THD ``packed_seq_params`` (the padded offsets, where each segment starts),
    else a one-row block-diagonal mask's; None for unpacked rows."""
    if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
        padded = packed_seq_params.cu_seqlens_q_padded
        return padded if padded is not None else packed_seq_params.cu_seqlens_q
    return packing.mask_segments(attention_mask)


@functools.cache
def packed_gated_delta_net(base: type, version: str) -> type:
    """megatron-core ``version``'s ``GatedDeltaNet`` class ``base``, running packed rows one sequence at a time.

    megatron passes the DeltaNet the same arguments as attention: a packed row's segments reach it as THD
    ``packed_seq_params`` (TransformerEngine) or only as the local attention's block-diagonal mask, which it ignores,
    so without this each sequence would start from the state the previous one left. 0.19.2 runs THD rows itself
    (its kernels take ``cu_seqlens``): a mask's segments become THD ``packed_seq_params``. 0.16.1 refuses THD rows
    and its forward has no ``cu_seqlens``: it runs with its convolution and rule bound to the segments
    (``patches.megatron_gated_deltanet.segments_bound``)."""

    class PackedGatedDeltaNet(base):
        def forward(self, hidden_states, attention_mask=None, **kwargs):
            offsets = _row_segments(attention_mask, kwargs.get("packed_seq_params"))
            if offsets is None:
                return super().forward(hidden_states, attention_mask, **kwargs)
            if self.config.deterministic_mode:  # megatron's deterministic torch rule takes no segments
                raise NotImplementedError("packed sequences through the gated DeltaNet need deterministic_mode off "
                                          "(megatron's deterministic rule has no cu_seqlens)")
            if version == "0.16.1":
                from patches.megatron_gated_deltanet import segments_bound

                with segments_bound(offsets):
                    return super().forward(hidden_states, attention_mask, **dict(kwargs, packed_seq_params=None))
            if kwargs.get("packed_seq_params") is None:
                kwargs["packed_seq_params"] = packing.packed_seq_params(offsets, int(offsets.diff().max()))
            return super().forward(hidden_states, attention_mask, **kwargs)

    return PackedGatedDeltaNet


def _backend(use_te: bool):
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    from megatron.core.models.backends import LocalSpecProvider

    return LocalSpecProvider()


def _deltanet_spec(use_te: bool):
    from megatron.core.transformer.spec_utils import ModuleSpec

    from patches.megatron_gated_deltanet import gated_delta_net_classes, installed_version

    GatedDeltaNet, GatedDeltaNetSubmodules = gated_delta_net_classes()
    backend = _backend(use_te)
    # TE: the input norm fused into in_proj (its layer_norm_weight); local: a plain column-parallel linear after the
    # layer's own input_layernorm
    in_proj = backend.column_parallel_layer_norm_linear() if use_te else backend.column_parallel_linear()
    return ModuleSpec(module=packed_gated_delta_net(GatedDeltaNet, installed_version()),
                      submodules=GatedDeltaNetSubmodules(in_proj=in_proj, out_norm=PlainRMSNorm,
                                                         out_proj=backend.row_parallel_linear()))


def _zero_centered(norm, use_te: bool):
    """The local spec's norm class made zero-centred (TE's norms read the config flag themselves)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return ZeroCenteredRMSNorm if not use_te and norm is WrappedTorchNorm else norm


def hybrid_spec(block, config, use_te: bool, first_layer: int):
    """``block`` (this pipeline stage's decoder block spec, its first layer global layer ``first_layer``) with the
    DeltaNet in the layers ``config.linear_attention_freq`` marks, and zero-centred norms on the local spec."""
    from megatron.core.transformer.identity_op import IdentityOp

    deltanet = _deltanet_spec(use_te)
    zero_centered = config.layernorm_zero_centered_gamma

    def layer(spec, index):
        sub = spec.submodules
        changes = {}
        if zero_centered:
            changes.update(input_layernorm=_zero_centered(sub.input_layernorm, use_te),
                           pre_mlp_layernorm=_zero_centered(sub.pre_mlp_layernorm, use_te))
            attention = sub.self_attention
            if hasattr(attention.submodules, "q_layernorm"):
                attention = dataclasses.replace(attention, submodules=dataclasses.replace(
                    attention.submodules, q_layernorm=_zero_centered(attention.submodules.q_layernorm, use_te),
                    k_layernorm=_zero_centered(attention.submodules.k_layernorm, use_te)))
            changes["self_attention"] = attention
        if config.linear_attention_freq[first_layer + index]:
            changes["self_attention"] = deltanet
            if use_te:  # TE's in_proj holds the input norm (its layer_norm_weight), as TE's linear_qkv does
                changes["input_layernorm"] = IdentityOp
            else:  # the local norm is saved under TE's name, so checkpoints move between the two specs
                keys = dict(sub.sharded_state_dict_keys_map)
                keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
                changes["sharded_state_dict_keys_map"] = keys
        return dataclasses.replace(spec, submodules=dataclasses.replace(sub, **changes))

    layer_norm = _zero_centered(block.layer_norm, use_te) if zero_centered else block.layer_norm
    return dataclasses.replace(block, layer_specs=[layer(s, i) for i, s in enumerate(block.layer_specs)],
                               layer_norm=layer_norm)
