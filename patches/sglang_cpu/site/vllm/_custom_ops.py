"""Pure-torch ``rotary_embedding``, the one op SGLang 0.5.23 takes from ``vllm._custom_ops`` on ``--device cpu``.

Same contract as vLLM's kernel: rotates ``query`` and ``key`` in place.
    positions      [T] long
    query, key     [T, num_heads * head_size] or [T, num_heads, head_size]
    cos_sin_cache  [max_position, rotary_dim]: cos in the first half of the columns, sin in the second
Only the first ``rotary_dim`` features of each head rotate. Neox style rotates (x[:d/2], x[d/2:]) pairs, GPT-J
style the interleaved (x[0::2], x[1::2]) pairs (SGLang's ``apply_rotary_emb``).
"""

from __future__ import annotations

import torch


def _rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, is_neox: bool) -> None:
    heads = x.view(x.shape[0], -1, head_size)
    rot = heads[..., : cos.shape[-1] * 2]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        rot.copy_(torch.cat((o1, o2), dim=-1))
    else:
        rot.copy_(torch.stack((o1, o2), dim=-1).flatten(-2))


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    cos, sin = cos_sin_cache[positions.reshape(-1).long()].chunk(2, dim=-1)  # [T, rotary_dim / 2] each
    cos, sin = cos.unsqueeze(-2).to(query.dtype), sin.unsqueeze(-2).to(query.dtype)
    _rotate_(query, cos, sin, head_size, is_neox)
    if key is not None:
        _rotate_(key, cos, sin, head_size, is_neox)
