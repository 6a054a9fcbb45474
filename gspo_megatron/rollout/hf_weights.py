"""Weights of an in-process Hugging Face transformers model as checkpoint-named tensors, and back.

transformers 5 keeps some weights in a fused in-memory layout (Qwen3-MoE: ``mlp.experts.gate_up_proj``
[E, 2I, H]) but saves and loads checkpoints in the original per-expert layout (``mlp.experts.3.gate_proj.weight``),
which is what SGLang loads and what the bridge exports. ``checkpoint_tensors`` applies transformers' own
save-time conversion (``revert_weight_conversion``, as ``save_pretrained`` does); ``load_checkpoint_tensors``
applies its load-time conversion by building the model through ``from_pretrained(state_dict=...)``.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .types import NamedTensors


def checkpoint_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` for every weight of a transformers model, in checkpoint layout."""
    from transformers.core_model_loading import revert_weight_conversion

    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    yield from revert_weight_conversion(model, state).items()


def load_checkpoint_tensors(model: torch.nn.Module, named_tensors: NamedTensors) -> torch.nn.Module:
    """A copy of ``model`` (same class, config and dtype) holding ``named_tensors``; every weight must be given."""
    state = {name: tensor.detach().to("cpu") for name, tensor in named_tensors}
    expected = {name for name, _ in checkpoint_tensors(model)}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint tensors do not match {type(model).__name__}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    dtype = next(model.parameters()).dtype
    new = type(model).from_pretrained(None, config=model.config, state_dict=state, dtype=dtype)
    return new.to(next(model.parameters()).device).eval()
