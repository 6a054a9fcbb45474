"""Kernels and fused ops: the vocab-parallel log-prob / entropy op (``logprob``), the policy loss fused with the
output layer (``sequence_loss``), and the naive reference."""

from .logprob import vocab_parallel_logprobs
from .sequence_loss import SequenceLoss, vocab_parallel_sequence_loss

__all__ = ["SequenceLoss", "vocab_parallel_logprobs", "vocab_parallel_sequence_loss"]
