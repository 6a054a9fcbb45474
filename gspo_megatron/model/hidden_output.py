"""Take the final hidden states out of a Megatron ``GPTModel`` instead of its logits.

The fused log-prob op needs the output layer's *input* and weight; letting ``GPTModel`` run its output layer
would materialise [tokens, V/tp] logits, which is what the op exists to avoid. For the duration of one
forward, the output layer's forward is replaced by a pass-through that records the weight GPTModel passes
(the embedding weight when embeddings are tied, else None).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """DistributedDataParallel / Float16Module / ... -> the GPTModel inside."""
    while hasattr(model, "module"):
        model = model.module
    return model


@dataclass
class OutputLayer:
    """What the output layer would have used: filled in during the forward on the last stage."""

    weight: torch.Tensor | None = None  # [V/tp, H]
    sequence_parallel: bool = False
    vocab_size: int | None = None  # real ids; rows past it are Megatron's vocabulary padding


@contextlib.contextmanager
def hidden_states_instead_of_logits(model: torch.nn.Module):
    """Within the block, ``model(...)`` returns [b, s_local, H] hidden states on the last pipeline stage.

    ``s_local`` is s / tp under sequence parallelism (the output layer would have gathered it). Yields an
    ``OutputLayer`` holding the weight to use. Other stages are unaffected (they have no output layer).
    """
    gpt = unwrap(model)
    layer = getattr(gpt, "output_layer", None) if getattr(gpt, "post_process", False) else None
    captured = OutputLayer()
    if layer is None:
        yield captured
        return
    captured.sequence_parallel = bool(getattr(layer, "sequence_parallel", False))
    captured.vocab_size = getattr(gpt, "unpadded_vocab_size", None)

    def pass_through(input_, weight=None, runtime_gather_output=None, **kwargs):
        captured.weight = weight if weight is not None else layer.weight
        return input_, None

    layer.forward = pass_through
    try:
        yield captured
    finally:
        del layer.forward  # back to the class's forward
