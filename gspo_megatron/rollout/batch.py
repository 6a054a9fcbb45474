"""Rollout samples -> the trainer's token-aligned tensors (``train.update.schedules``' micro-batch layout).

For a sample with prompt p (P tokens) and response r (R tokens), row b holds input_ids = p + r, right-padded, and
    labels[b, t]       = input_ids[b, t + 1]            (the next token)
    loss_mask[b, t]    = P - 1 <= t <= P + R - 2         (labels[b, t] is a response token)
                         and response_mask[t - P + 1]     (a token the model sampled: multi-turn observations
                                                           are in input_ids but carry no loss)
    rollout_logprobs   = the engine's log-prob of labels[b, t] where loss_mask, else 0
    token_versions     = the weight version that sampled labels[b, t] (partial rollouts only; -1 off responses)
so the log-prob the trainer computes at position t is comparable with the engine's, token for token.

Samples with ``rollout_routing`` (the engine's experts: rollout routing replay) add rollout_routing [B, S, layers,
top-k] int16: row t is the experts the engine routed input_ids[b, t] to, for t <= P + R - 2 (every position whose
label is a token). The last token and the padding were never routed by the engine; they get experts 0..k-1 (any
valid choice: causal attention keeps them from the positions that count, and no loss is taken there).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .types import Sample


def samples_to_batch(samples: Sequence[Sample], pad_id: int = 0, pad_to_multiple: int = 1,
                     min_length: int = 0) -> dict[str, torch.Tensor]:
    """input_ids / labels [B, S] long, loss_mask [B, S] bool, rollout_logprobs [B, S] float32,
    prompt_lengths / response_lengths [B] long. S = the longest prompt + response, padded up to a multiple of
    ``pad_to_multiple`` (e.g. the TP size under sequence parallelism) and at least ``min_length``."""
    if not samples:
        raise ValueError("samples_to_batch got no samples")
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    S = max(longest, min_length)
    S = -(-S // pad_to_multiple) * pad_to_multiple
    B = len(samples)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    labels = torch.full((B, S), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    logprobs = torch.zeros(B, S, dtype=torch.float32)
    for b, s in enumerate(samples):
        P, R = len(s.prompt_ids), len(s.response_ids)
        ids = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        input_ids[b, :P + R] = ids
        labels[b, :P + R - 1] = ids[1:]
        if R:
            mask = s.mask_tensor()
            loss_mask[b, P - 1:P + R - 1] = mask
            logprobs[b, P - 1:P + R - 1] = torch.where(mask, s.logprobs_tensor(), 0.0)
    out = {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "rollout_logprobs": logprobs,
        "prompt_lengths": torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long),
        "response_lengths": torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long),
    }
    if any(s.token_versions is not None for s in samples):  # partial rollouts: each token's weight version
        out["token_versions"] = torch.full((B, S), -1, dtype=torch.long)  # -1: no response token
        for b, s in enumerate(samples):
            P, R = len(s.prompt_ids), len(s.response_ids)
            if R and s.token_versions is not None:
                out["token_versions"][b, P - 1:P + R - 1] = torch.tensor(s.token_versions, dtype=torch.long)
    if any(s.rollout_routing is not None for s in samples):
        out["rollout_routing"] = rollout_routing_batch(samples, S)
    return out


def rollout_routing_batch(samples: Sequence[Sample], S: int) -> torch.Tensor:
    """The samples' rollout_routing as the batch's [B, S, layers, top-k] int16 (see the module docstring)."""
    shapes = {tuple(s.rollout_routing.shape[1:]) for s in samples if s.rollout_routing is not None}
    missing = [s.name for s in samples if s.rollout_routing is None]
    if missing or len(shapes) != 1:
        raise ValueError(f"rollout routing: every sample needs routed experts of one [layers, top-k] shape; "
                         f"missing for {missing[:4]}, shapes {sorted(shapes)}")
    layers, topk = shapes.pop()
    routing = torch.arange(topk, dtype=torch.int16).expand(len(samples), S, layers, topk).clone()
    for b, s in enumerate(samples):
        routing[b, :s.rollout_routing.shape[0]] = s.rollout_routing
    return routing
