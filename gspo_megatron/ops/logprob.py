"""Per-token log-probabilities (and entropy) of targets under a vocab-parallel output layer, without [T, V] logits.

    logp_t = z_{t, y_t} - logsumexp_v z_{t, v},    H_t = -sum_v p_{t, v} log p_{t, v},
    z = (hidden @ W.T) / temperature

W is split by rows (vocabulary) over the tensor-parallel group, as in Megatron's output layer. Temperature
divides the logits before the softmax, as SGLang does for the log-probs of sampled tokens, so train-side log-probs
match the rollout's. Only ``vocab_size`` real ids take part: the rows Megatron pads the vocabulary with are
excluded, as inference engines slice them off the logits before the softmax (e.g. vLLM's LogitsProcessor).
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from . import _tp_comm as comm
from ._logprob_function import VocabParallelLogprob

__all__ = ["BACKENDS", "CHUNK_ELEMENTS", "GPU_BUFFER_FRACTION", "MIN_CHUNK_TOKENS", "auto_chunk_size",
           "select_backend", "vocab_parallel_logprobs"]

# Auto chunk size on CPU (bench/logprob.py, bench/RESULTS.md): a [chunk, V/tp] fp32 buffer of at most 64 MiB, but
# never fewer than 256 tokens, below which the chunk matmuls lose speed (on CPU: ~25% more time at 110 tokens). For
# V=151936 that is 256 tokens at TP=1 and 2 (155 / 78 MB per buffer), 883 at TP=8.
CHUNK_ELEMENTS = 1 << 24
MIN_CHUNK_TOKENS = 256
# On CUDA the chunk buffers may take this fraction of the memory free at the call (the driver's free memory plus
# what PyTorch's allocator holds unused): an RL-length micro batch then fits one chunk, and the rest of the step
# (activations of the backward still to come, the optimizer) keeps three quarters.
GPU_BUFFER_FRACTION = 0.25

# "torch": the chunked torch Functions (fp32 statistics and GEMMs; the reference). "triton": bf16/fp16/fp32 operands
# with fp32 accumulation and the Triton kernels (``_triton_functions``). "auto": triton for 16-bit CUDA inputs.
BACKENDS = ("auto", "torch", "triton")


def auto_chunk_size(shard_rows: int, device: torch.device | str = "cpu", bytes_per_element: int = 4,
                    buffers: int = 1) -> int:
    """Tokens per chunk for a vocabulary shard of ``shard_rows`` rows.

    CPU: ``CHUNK_ELEMENTS`` per buffer (at least ``MIN_CHUNK_TOKENS``). CUDA: ``buffers`` [chunk, shard_rows]
    buffers of ``bytes_per_element`` within ``GPU_BUFFER_FRACTION`` of the free memory (at least
    ``MIN_CHUNK_TOKENS``).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return max(MIN_CHUNK_TOKENS, CHUNK_ELEMENTS // max(1, shard_rows))
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    per_token = max(1, shard_rows) * bytes_per_element * buffers
    return max(MIN_CHUNK_TOKENS, int(free * GPU_BUFFER_FRACTION) // per_token)


def select_backend(backend: str, device: torch.device, dtype: torch.dtype,
                   weight_dtype: torch.dtype | None = None) -> str:
    """"torch" or "triton" for inputs on ``device`` in ``dtype`` (the weight in ``weight_dtype``, default the same);
    see ``BACKENDS``. The kernels take operands of one dtype; "auto" leaves mixed ones to the torch path."""
    weight_dtype = weight_dtype or dtype
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        sixteen_bit = dtype in (torch.bfloat16, torch.float16) and weight_dtype == dtype
        return "triton" if device.type == "cuda" and sixteen_bit else "torch"
    if backend == "triton":
        if dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight_dtype != dtype:
            raise ValueError(f"backend='triton' takes bf16, fp16 or fp32 inputs of one dtype, got hidden {dtype} "
                             f"and weight {weight_dtype}")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend='triton' runs on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1)")
    return backend


def _chunk_size(chunk_size: int | None, backend: str, hidden: torch.Tensor, shard_rows: int, with_entropy: bool):
    if chunk_size is not None:
        return chunk_size
    if backend == "triton":  # one gradient buffer in the operands' dtype
        return auto_chunk_size(shard_rows, hidden.device, hidden.element_size())
    return auto_chunk_size(shard_rows, hidden.device, 4, 2 if with_entropy else 1)


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    sequence_parallel: bool = False,
    vocab_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token, and optionally the entropy of each token's distribution.

    hidden: [T, H] or [s, b, H] final hidden states (the output layer's input), replicated over ``tp_group``;
        with ``sequence_parallel``, this rank's block of the first dim ([T/tp, H] or [s/tp, b, H]).
        Pass it directly: the op sums the hidden gradient over the TP group itself (do not also route it through
        ``copy_to_tensor_model_parallel_region``).
    weight: [V/tp, H] this rank's rows of the output layer (rank r holds global ids [r*V/tp, (r+1)*V/tp)).
    targets: [T] or [s, b] global token ids in [0, vocab_size), for all tokens (also under sequence parallel).
    tp_group: the tensor-parallel group the vocabulary is split over; None (or a group of one): no collectives.
    temperature: logits are divided by it before the softmax.
    chunk_size: tokens per chunk. The torch backend's temporaries are one (log-prob only) or two (with entropy)
        [chunk, V/tp] fp32 buffers; the triton backend's forward needs none, its backward one in the inputs' dtype.
        None: ``auto_chunk_size`` (on CUDA, from the free memory).
    vocab_size: real vocabulary size when ``weight`` holds Megatron's padding rows (default: all V rows are real).
    backend: "auto" (Triton kernels for bf16/fp16 CUDA inputs, the torch path otherwise), "torch" or "triton".

    Returns fp32 (float64 for float64 inputs) tensors of ``targets``' shape, identical on every TP rank:
    logp, or (logp, entropy) if ``return_entropy``. Both are differentiable w.r.t. hidden and weight.
    """
    tp, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
    shard_rows = _check_inputs(
        hidden, weight, targets, tp, rank, temperature, chunk_size, sequence_parallel, vocab_size
    )
    backend = select_backend(backend, hidden.device, hidden.dtype, weight.dtype)
    chunk_size = _chunk_size(chunk_size, backend, hidden, shard_rows, return_entropy)
    out = _implementation(backend).apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1),
        tp_group,
        float(temperature),
        bool(return_entropy),
        int(chunk_size),
        rank * weight.shape[0],
        shard_rows,
        bool(sequence_parallel) and tp > 1,
    )
    if return_entropy:
        return out[0].view(targets.shape), out[1].view(targets.shape)
    return out.view(targets.shape)


def _implementation(backend: str) -> type[torch.autograd.Function]:
    """The autograd Function of ``backend`` ("torch": the chunk loop, the reference; "triton": the kernels)."""
    if backend == "torch":
        return VocabParallelLogprob
    from ._triton_functions import TritonVocabParallelLogprob  # imports triton: only where it runs

    return TritonVocabParallelLogprob


def _check_inputs(hidden, weight, targets, tp, rank, temperature, chunk_size, sequence_parallel, vocab_size) -> int:
    """Validate the arguments; return how many rows of this rank's weight shard are real vocabulary."""
    for name, value in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if hidden.dim() not in (2, 3) or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a float [T, H] or [s, b, H] tensor, got {hidden.dtype} {tuple(hidden.shape)}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a float [V/tp, H] tensor, got {weight.dtype} {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight has hidden size {weight.shape[1]} but hidden has {hidden.shape[-1]}")
    if weight.shape[0] == 0:
        raise ValueError("weight has no vocabulary rows")
    if weight.device != hidden.device or targets.device != hidden.device:
        raise ValueError(
            f"hidden, weight and targets must be on one device, got {hidden.device}, {weight.device}, {targets.device}"
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be an integer tensor of token ids, got {targets.dtype}")
    tokens = tuple(hidden.shape[:-1])
    if sequence_parallel and tp > 1:
        tokens = (tokens[0] * tp, *tokens[1:])
    if tuple(targets.shape) != tokens:
        where = f" (hidden is this rank's 1/{tp} of the sequence)" if sequence_parallel and tp > 1 else ""
        raise ValueError(
            f"targets has shape {tuple(targets.shape)} but hidden {tuple(hidden.shape)}{where} has tokens {tokens}"
        )
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")

    shard = weight.shape[0]
    padded = shard * tp
    vocab = padded if vocab_size is None else vocab_size
    if not (isinstance(vocab, int) and (tp - 1) * shard < vocab <= padded):
        # Every rank must own at least one real id; Megatron pads by < tp * 128 rows, far less than a shard.
        raise ValueError(
            f"vocab_size must be in ({(tp - 1) * shard}, {padded}] for a weight shard of {shard} rows x tp={tp}, "
            f"got {vocab_size!r}"
        )
    if targets.numel():
        low, high = torch.stack(torch.aminmax(targets)).tolist()  # one host sync; cheap next to the matmuls
        if low < 0 or high >= vocab:
            raise ValueError(f"targets must lie in [0, {vocab}) (the vocabulary), got ids from {low} to {high}")
    return min(shard, vocab - rank * shard)
