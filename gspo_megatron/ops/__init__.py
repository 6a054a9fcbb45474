"""Kernels and fused ops: the vocab-parallel log-prob / entropy op (``logprob``) and its naive reference."""

from .logprob import vocab_parallel_logprobs

__all__ = ["vocab_parallel_logprobs"]
