"""A context-parallel core attention for the CPU tests, standing in for TransformerEngine's (which needs CUDA).

megatron-core's local ``DotProductAttention`` refuses context parallelism, so without TE no model-path CP test
could run here. This module is the plain all-gather form of CP attention (TE's ``cp_comm_type="all_gather"``):
every CP rank gathers the keys and values of the whole sequence (megatron's load-balanced chunks put back in
order) and attends its own queries causally by their global positions. Everything around attention is
megatron's and ours, unchanged: RoPE sliced per CP rank, the batch split, the loss's CP sums, the gathered
log-probs, the DP x CP gradient reduction. Tests only: it is not part of the package.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.transformer.module import MegatronModule

from gspo_megatron.parallel.context import packed_token_index, token_index


class _GatherSequence(torch.autograd.Function):
    """[s_local, ...] on each CP rank -> [cp * s_local, ...] in rank order; backward sums over the group (each
    rank's keys are attended by every rank's queries) and keeps this rank's slice. all_reduce, not reduce_scatter:
    gloo has no reduce_scatter."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        n = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * n:(rank + 1) * n], None


class AllGatherCPAttention(MegatronModule):
    """Causal attention over the whole sequence for this CP rank's queries: [sq, b, np, hn] -> [sq, b, np*hn]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        tp = ps.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        group = ps.get_context_parallel_group()
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        thd = packed_seq_params is not None
        if thd:  # packed rows (megatron squeezed the batch dim: [t, heads, dim]): each segment attends to itself
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            offsets = packed_seq_params.cu_seqlens_q_padded.to(torch.int64).cpu()
            seq_len = int(offsets[-1])
            shares = [packed_token_index(offsets, cp, r) for r in range(cp)]
            segment = torch.repeat_interleave(torch.arange(offsets.numel() - 1), offsets.diff())  # [S]
        else:
            seq_len = query.shape[0] * cp
            shares = [token_index(seq_len, cp, r) for r in range(cp)]
        sq = query.shape[0]
        order = torch.argsort(torch.cat(shares))  # the gathered rows back in sequence order
        key = _GatherSequence.apply(key, group)[order]  # [S, b, ng, hn]
        value = _GatherSequence.apply(value, group)[order]
        if self.heads > self.groups:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        q_pos = shares[rank]
        allowed = torch.arange(seq_len).unsqueeze(0) <= q_pos.unsqueeze(1)  # [sq, S]: causal by global position
        if thd:
            allowed &= segment.unsqueeze(0) == segment[q_pos].unsqueeze(1)
        # [b, np, s, hn]
        out = F.scaled_dot_product_attention(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3),
                                             value.permute(1, 2, 0, 3), attn_mask=allowed, scale=self.scale)
        out = out.permute(2, 0, 1, 3).reshape(sq, query.shape[1], -1)
        return out[:, 0] if thd else out
