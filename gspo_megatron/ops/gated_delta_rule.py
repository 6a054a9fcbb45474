"""The gated delta rule (Gated DeltaNet's recurrence) in pure torch, chunked, with packed sequences (varlen).

What flash-linear-attention's Triton kernels compute, for the CPU (they need a GPU): per head, with the state
S [K, V] starting at zero (or ``initial_state``) at each sequence's first token,

    S_t = exp(g_t) * S_{t-1} + beta_t * k_t (v_t - exp(g_t) * S_{t-1}^T k_t)^T,    o_t = scale * S_t^T q_t

(``recurrent_gated_delta_rule`` is that loop, the reference). ``chunk_gated_delta_rule`` computes the same in chunks
of 64 tokens (the WY representation transformers and megatron-core's ``torch_chunk_gated_delta_rule`` use): the
intra-chunk part as a triangular solve, the state carried across chunks. ``cu_seqlens`` ([N + 1] offsets into a
batch of one, fla's convention) marks packed sequences: each runs from a fresh state, so a packed batch equals the
sequences run one by one. ``causal_conv1d`` is the DeltaNet's depthwise causal convolution, also restarted at each
packed sequence's first token.

Shapes (fla's layout): q, k [B, T, H, K]; v [B, T, H, V]; g, beta [B, T, H]; out [B, T, H, V]; state [B|N, H, K, V].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps), as fla's ``l2norm`` (and transformers') normalises q and k."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None):
    """The rule token by token (the reference). One sequence per batch row; returns (out, final state)."""
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    b, t, h, dk = k.shape
    scale = dk ** -0.5 if scale is None else scale
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.float().clone()
    out = []
    for i in range(t):
        state = state * g[:, i, :, None, None].exp()
        error = v[:, i] - torch.einsum("bhkv,bhk->bhv", state, k[:, i])
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, i], error * beta[:, i, :, None])
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, i] * scale))
    return torch.stack(out, dim=1).to(dtype), state


def _chunked(q, k, v, g, beta, scale, state):
    """One batch of equal-length sequences, [B, H, T, *] in fp32; returns (out [B, H, T, V], final state)."""
    b, h, t, dk = k.shape
    pad = (CHUNK - t % CHUNK) % CHUNK
    # zero padding: k = 0 and beta = 0 leave the state alone, g = 0 does not decay it; padded outputs are dropped
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // CHUNK
    q = q * scale
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, v, k_beta, v_beta = (x.reshape(b, h, n, CHUNK, x.shape[-1]) for x in (q, k, v, k_beta, v_beta))
    g = g.reshape(b, h, n, CHUNK).cumsum(dim=-1)
    decay = (g[..., :, None] - g[..., None, :]).tril().exp().tril()  # [.., i, j] = exp(g_i - g_j), j <= i
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu()
    # (I + strictly-lower(beta k k^T decay))^-1 by forward substitution: the WY representation of the chunk
    attn = -((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(upper, 0)
    for i in range(1, CHUNK):  # clones: autograd must see each row as it was before this step wrote it
        row, sub = attn[..., i, :i].clone(), attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row[..., None] * sub).sum(-2)
    attn = attn + torch.eye(CHUNK, dtype=attn.dtype, device=attn.device)
    u = attn @ v_beta
    w = attn @ (k_beta * g.exp()[..., None])
    strict_upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    out = torch.zeros_like(u)
    for i in range(n):
        q_i, k_i = q[:, :, i], k[:, :, i]
        local = (q_i @ k_i.transpose(-1, -2) * decay[:, :, i]).masked_fill(strict_upper, 0)
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = (q_i * g[:, :, i, :, None].exp()) @ state + local @ v_new
        last = g[:, :, i, -1]
        state = state * last[..., None, None].exp() + (
            k_i * (last[..., None] - g[:, :, i]).exp()[..., None]).transpose(-1, -2) @ v_new
    return out.reshape(b, h, n * CHUNK, -1)[:, :, :t], state


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **unused):
    """fla's ``chunk_gated_delta_rule`` in torch: (out [B, T, H, V], final state or None). With ``cu_seqlens`` the
    batch is one row of packed sequences, each from its own ``initial_state`` row (zero if None)."""
    dtype = v.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))  # [B, H, T, *]
    if cu_seqlens is None:
        b, h, _, dk = k.shape
        state = (q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.float())
        out, state = _chunked(q, k, v, g, beta, scale, state)
        return out.transpose(1, 2).to(dtype), (state if output_final_state else None)
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens packs sequences into a batch of one row, got {q.shape[0]} rows")
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        part = [x[:, :, start:end] for x in (q, k, v, g, beta)]
        state = (q.new_zeros(1, q.shape[1], k.shape[-1], v.shape[-1]) if initial_state is None
                 else initial_state[n:n + 1].float())
        out, state = _chunked(*part, scale, state)
        outs.append(out)
        states.append(state)
    out = torch.cat(outs, dim=2).transpose(1, 2).to(dtype)
    return out, (torch.cat(states) if output_final_state else None)


def causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None):
    """Depthwise causal convolution: x [B, D, T], weight [D, W] -> [B, D, T]; each packed sequence of
    ``cu_seqlens`` (B = 1) sees only its own tokens (zeros before its first)."""
    width = weight.shape[-1]
    if cu_seqlens is None:
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[1])[..., : x.shape[-1]]
    else:
        bounds = cu_seqlens.tolist()
        out = torch.cat([causal_conv1d(x[..., s:e], weight, bias) for s, e in zip(bounds[:-1], bounds[1:])], -1)
        return F.silu(out) if activation in ("silu", "swish") else out
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: activation {activation!r} (silu, swish or None)")
    return out
