"""MiniMax-M2: its config fields and its q/k RMSNorm over the whole projection, TP-aware.

MiniMax-M2's attention normalises q and k each over the whole projection (all heads at once: ``q_norm.weight`` has
``num_attention_heads * head_dim`` entries, ``k_norm.weight`` ``num_key_value_heads * head_dim``; the config's
``qk_norm_type: per_layer``), where megatron-core's ``qk_layernorm`` normalises each head on its own. Under TP a
rank holds only its heads, so the mean of squares spans the TP ranks: ``WholeProjectionRMSNorm`` sums each token's
squares over the local heads, all-reduces that sum over the TP group (forward and backward: every rank's output
depends on every rank's heads) and scales by the local slice of the weight, which is split over TP with the heads
(as SGLang's ``MiniMaxM2RMSNormTP`` holds it). One scalar per token crosses the TP group, not the projection (slime
gathers q and k whole, normalises and scatters them back).

The rest is data: the sigmoid router with ``e_score_correction_bias`` (no groups, no scaling, always renormalised:
``Family.implied``), RoPE on ``rotary_dim`` of each head (``rotary_percent``), every layer MoE, experts stored per
expert as ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down) (mapping.MINIMAX_M2), MTP
modules stored as layers ``num_hidden_layers + i`` (carried), FP8 block checkpoints (``fp8``).
"""

from __future__ import annotations

import dataclasses

import torch

from .errors import UnsupportedModel

# attn_type_list: 1 is softmax attention, 0 MiniMax-Text-01's lightning (linear) attention, which is not mapped
SOFTMAX_ATTENTION = 1


def minimax_m2_fields(config: dict, num_layers: int) -> dict:
    """ModelSpec's MiniMax-M2 fields from config.json, or ``UnsupportedModel`` naming the field."""
    kinds = config.get("attn_type_list") or [SOFTMAX_ATTENTION] * num_layers
    if len(kinds) != num_layers or any(k != SOFTMAX_ATTENTION for k in kinds):
        raise UnsupportedModel(f"attn_type_list={kinds} in config.json: only softmax attention (1) in each of the "
                               f"{num_layers} layers is supported for minimax_m2 (lightning attention is not mapped)")
    return dict(qk_norm_whole_projection=True)


class WholeProjectionRMSNorm(torch.nn.Module):
    """RMSNorm over all of a rank's q (or k) heads together with the other TP ranks' (HF's ``q_norm`` / ``k_norm``).

    Sits in megatron's ``q_layernorm`` / ``k_layernorm`` slot, which gets [..., local heads, head_dim] (sequence,
    batch or packed tokens first). ``weight`` is this rank's [local heads * head_dim] slice. As transformers'
    ``MiniMaxM2RMSNorm``: the mean of squares in fp32, the normalised input cast back, then times the weight."""

    heads_field = "num_attention_heads"

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        heads = getattr(config, self.heads_field)
        self.total = heads * hidden_size  # the whole projection's width: what the mean is over
        self.weight = torch.nn.Parameter(torch.ones(heads // tp * hidden_size, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)  # a TP shard, not a duplicate
        self.eps = eps
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed.nn.functional as dist_nn

        squares = x.float().pow(2).sum(dim=(-2, -1), keepdim=True)
        if self.tp > 1:
            # summed backward too: each rank's output depends on the other ranks' heads through the sum
            squares = dist_nn.all_reduce(squares, group=self.tp_group)
        normed = (x.float() * torch.rsqrt(squares / self.total + self.eps)).to(x.dtype)
        return self.weight.view(x.shape[-2:]) * normed

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Dist-checkpoint keys: the weight sharded over TP on dim 0 (megatron would save a plain module's tensors
        as TP replicas, rank 0's shard only)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets)


class WholeProjectionKeyNorm(WholeProjectionRMSNorm):
    heads_field = "num_query_groups"


def whole_projection_norm_spec(block):
    """The decoder block spec with each layer's q/k norm replaced by ``WholeProjectionRMSNorm`` (both specs)."""
    layers = []
    for layer in block.layer_specs:
        attention = layer.submodules.self_attention
        submodules = dataclasses.replace(attention.submodules, q_layernorm=WholeProjectionRMSNorm,
                                         k_layernorm=WholeProjectionKeyNorm)
        attention = dataclasses.replace(attention, submodules=submodules)
        layers.append(dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules,
                                                                               self_attention=attention)))
    return dataclasses.replace(block, layer_specs=layers)


def fix_megatron_parameters(model) -> None:
    """Turn off megatron's q/k norm gradient reduction once the model is built.

    megatron-core builds the spec's q/k norm only with ``qk_layernorm`` on (0.19 refuses a spec's norm otherwise),
    and ``finalize_model_grads`` then sums over TP the gradient of every parameter named ``q_layernorm`` /
    ``k_layernorm``, as a per-head norm shared by the heads of every rank needs. The whole-projection norm's weight is
    split over TP: each rank's gradient is its shard's, complete; summed, it would mix the shards. The model's config
    (what ``finalize_model_grads`` reads) says no more (as ``provider.freeze_expert_bias`` does for the bias)."""
    model.config.qk_layernorm = False
