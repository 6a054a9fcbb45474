"""Triton kernels of the log-prob op on CUDA: the logits GEMM with the softmax statistics, or with the logits'
gradient, in its epilogue. The [T, V_shard] logits are never written to memory.

    shard_stats(h, w, targets, temperature, with_entropy) -> [T, 4]      (m_r, s_r, z_y or 0, u_r or 0)
    logits_grad(h, w, targets, lse, entropy, a, b, temperature, out)    out[t, v] = d/dx_tv, x = h @ w.T

Both compute a tile z = (h[rows] @ w[cols].T) / temperature with operands in their own dtype (bf16 / fp16: tensor
cores; fp32: IEEE, not TF32) and fp32 accumulation, then

- statistics: an online softmax over the tile's columns, per row, relative to a running max m (``_shard_softmax``'s
  m_r, s_r, u_r), and the target's logit where the tile holds it. A program covers a block of rows and one slice of
  the vocabulary; the slices' partial statistics merge exactly (``_shard_softmax.merge_shard_stats``), as the TP
  ranks' do, so short inputs still fill the GPU.
- gradient: with per-token factors a = -g_logp / temperature and b = -g_H / temperature (``_shard_softmax``'s
  backward), d/dx_v = p_v (a + b (log p_v + H)) - a [v = y], written in ``out``'s dtype (the operands'). The two
  gradient GEMMs (G @ W, G.T @ h) are cuBLAS's.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) they run on CPU tensors, for tests; the
interpreter does not support bf16 ``tl.dot`` (triton-lang/triton#11584), so tests use fp16 and fp32 operands.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._shard_softmax import merge_shard_stats

__all__ = ["KernelConfig", "config_for", "interpreted", "logits_grad", "shard_stats"]


@dataclass(frozen=True)
class KernelConfig:
    block_t: int  # rows (tokens) per tile
    block_v: int  # columns (vocabulary rows) per tile
    block_h: int  # hidden (reduction) step
    num_warps: int = 4
    num_stages: int = 2


# 16-bit operands on H100/H200: Triton's matmul tutorial's large-problem tile, with 128 columns instead of 256 so the
# fp32 epilogue (exp, the online statistics) fits the registers. fp32 operands (IEEE) use half-size tiles.
CUDA_16BIT = KernelConfig(128, 128, 64, num_warps=8, num_stages=3)
CUDA_FP32 = KernelConfig(64, 64, 32, num_warps=4, num_stages=2)
INTERPRETER = KernelConfig(16, 16, 16)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def config_for(h: torch.Tensor) -> KernelConfig:
    if not h.is_cuda:
        return INTERPRETER
    return CUDA_FP32 if h.dtype == torch.float32 else CUDA_16BIT


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
                 BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, IEEE: tl.constexpr):
    """z = h[rows] @ w[cols].T * inv_temp: [BLOCK_T, BLOCK_V] fp32 (0 outside the valid rows / columns)."""
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_w  # w read as [BLOCK_H, BLOCK_V]: w.T's tile
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < H
        a = tl.load(h_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc * inv_temp


@triton.jit
def _stats_kernel(h_ptr, w_ptr, target_ptr, out_ptr, T, V, H, stride_h, stride_w, inv_temp, cols_per_split,
                  BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                  WITH_ENTROPY: tl.constexpr, IEEE: tl.constexpr):
    """Program (row block, vocabulary slice): out[slice, rows] = (m, s, z_y, u) over the slice's columns."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    target = tl.load(target_ptr + rows, mask=row_ok, other=-1)
    col_start = tl.program_id(1) * cols_per_split
    col_stop = tl.minimum(col_start + cols_per_split, V)
    m = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)
    u = tl.zeros((BLOCK_T,), dtype=tl.float32)
    z_target = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for v0 in range(col_start, col_stop, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < col_stop
        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
                         BLOCK_T, BLOCK_V, BLOCK_H, IEEE)
        z_target += tl.sum(tl.where((cols[None, :] == target[:, None]) & col_ok[None, :], z, 0.0), axis=1)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        rescale = tl.exp(m - m_new)  # 0 on the first tile (m = -inf)
        shifted = z - m_new[:, None]  # <= 0; -inf in masked columns
        e = tl.exp(shifted)  # 0 in masked columns
        if WITH_ENTROPY:
            # u relative to the new max: sum e^(z - m') (z - m') = e^(m - m') (u + (m - m') s) for the old columns.
            moved = tl.where(s > 0.0, m - m_new, 0.0)
            u = rescale * (u + moved * s) + tl.sum(e * tl.where(col_ok[None, :], shifted, 0.0), axis=1)
        s = rescale * s + tl.sum(e, axis=1)
        m = m_new
    out = out_ptr + (tl.program_id(1) * T + rows.to(tl.int64)) * 4
    tl.store(out + 0, m, mask=row_ok)
    tl.store(out + 1, s, mask=row_ok)
    tl.store(out + 2, z_target, mask=row_ok)
    tl.store(out + 3, u, mask=row_ok)


@triton.jit
def _grad_kernel(h_ptr, w_ptr, target_ptr, lse_ptr, entropy_ptr, a_ptr, b_ptr, g_ptr, T, V, H, stride_h, stride_w,
                 stride_g, inv_temp, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                 WITH_ENTROPY_GRAD: tl.constexpr, IEEE: tl.constexpr):
    """Program (row block, column block): g[rows, cols] = p (a + b (log p + H)) - a [v = y]."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok, col_ok = rows < T, cols < V
    z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
                     BLOCK_T, BLOCK_V, BLOCK_H, IEEE)
    target = tl.load(target_ptr + rows, mask=row_ok, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    a = tl.load(a_ptr + rows, mask=row_ok, other=0.0)
    logp = z - lse[:, None]
    coef = a[:, None] + tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    if WITH_ENTROPY_GRAD:
        b = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
        entropy = tl.load(entropy_ptr + rows, mask=row_ok, other=0.0)
        coef += b[:, None] * (logp + entropy[:, None])
    g = tl.exp(logp) * coef - tl.where(cols[None, :] == target[:, None], a[:, None], 0.0)
    out = g_ptr + rows.to(tl.int64)[:, None] * stride_g + cols[None, :]
    tl.store(out, g.to(g_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check(h: torch.Tensor, w: torch.Tensor) -> None:
    if h.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.dtype != h.dtype:
        raise ValueError(f"the Triton kernels take bf16, fp16 or fp32 operands of one dtype, got {h.dtype}, {w.dtype}")
    if not (h.is_cuda or interpreted()):
        raise ValueError("the Triton kernels run on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1)")
    if h.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("the Triton kernels need rows with unit stride (call .contiguous())")


def _splits(tokens: int, vocab: int, config: KernelConfig, device: torch.device) -> tuple[int, int]:
    """(vocabulary slices, columns per slice): enough programs for two waves over the GPU's SMs, each slice a whole
    number of column blocks and none empty."""
    row_blocks = triton.cdiv(tokens, config.block_t)
    col_blocks = triton.cdiv(vocab, config.block_v)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = max(1, min(col_blocks, triton.cdiv(2 * sms, row_blocks)))
    per_split = triton.cdiv(col_blocks, wanted) * config.block_v
    return triton.cdiv(vocab, per_split), per_split


def shard_stats(h: torch.Tensor, w: torch.Tensor, local_targets: torch.Tensor, temperature: float,
                with_entropy: bool, config: KernelConfig | None = None) -> torch.Tensor:
    """This shard's softmax statistics [T, 4] fp32 (``_shard_softmax.shard_stats_``'s columns), without logits.

    h: [T, H]; w: [V_shard, H] (real vocabulary rows only); local_targets: [T] target ids minus the shard's first
    id (outside [0, V_shard): not this shard's). Entropy column 0 unless ``with_entropy``.
    """
    _check(h, w)
    config = config or config_for(h)
    (tokens, hidden), vocab = h.shape, w.shape[0]
    if tokens == 0:
        return h.new_zeros(0, 4, dtype=torch.float32)
    splits, per_split = _splits(tokens, vocab, config, h.device)
    partial = torch.empty(splits, tokens, 4, dtype=torch.float32, device=h.device)
    grid = (triton.cdiv(tokens, config.block_t), splits)
    _stats_kernel[grid](
        h, w, local_targets.contiguous(), partial, tokens, vocab, hidden, h.stride(0), w.stride(0),
        1.0 / temperature, per_split, BLOCK_T=config.block_t, BLOCK_V=config.block_v, BLOCK_H=config.block_h,
        WITH_ENTROPY=bool(with_entropy), IEEE=h.dtype == torch.float32, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits == 1:
        return partial[0]
    merged = merge_shard_stats(partial)
    if not with_entropy:
        merged[:, 3] = 0  # the merge's shift terms would make a (meaningless) u: keep the column 0, as documented
    return merged


def logits_grad(h: torch.Tensor, w: torch.Tensor, local_targets: torch.Tensor, lse: torch.Tensor,
                entropy: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor | None, temperature: float,
                out: torch.Tensor, config: KernelConfig | None = None) -> torch.Tensor:
    """d/dx of the loss for logits x = h @ w.T, written into ``out`` [T, V_shard] (the operands' dtype) and returned.

    lse, entropy: [T] fp32 combined statistics; a = -g_logp / temperature, b = -g_H / temperature: [T] fp32 (b and
    entropy None without an entropy gradient).
    """
    _check(h, w)
    config = config or config_for(h)
    (tokens, hidden), vocab = h.shape, w.shape[0]
    if tuple(out.shape) != (tokens, vocab) or out.stride(1) != 1:
        raise ValueError(f"out must be a row-major [{tokens}, {vocab}] tensor, got {tuple(out.shape)}")
    if tokens == 0:
        return out
    with_entropy = b is not None
    grid = (triton.cdiv(tokens, config.block_t), triton.cdiv(vocab, config.block_v))
    _grad_kernel[grid](
        h, w, local_targets.contiguous(), lse.contiguous(), entropy.contiguous() if with_entropy else lse,
        a.contiguous(), b.contiguous() if with_entropy else a, out, tokens, vocab, hidden, h.stride(0), w.stride(0),
        out.stride(0), 1.0 / temperature, BLOCK_T=config.block_t, BLOCK_V=config.block_v, BLOCK_H=config.block_h,
        WITH_ENTROPY_GRAD=with_entropy, IEEE=h.dtype == torch.float32, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
