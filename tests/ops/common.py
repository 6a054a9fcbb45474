"""What the op tests share: tolerances, the relative difference they are measured in, and the TP=2 verdict."""

from __future__ import annotations

import torch

# max |a - e| / max |e| against a float64 naive reference: fp32 ops are close, float64 ones exact.
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def rel_diff(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """max |a - e| / max |e|, or / ``scale`` where given."""
    scale = expected.abs().max() if scale is None else scale
    return ((actual.double() - expected).abs().max() / scale.clamp(min=1e-30)).item()


def diffs(actual: dict, expected: dict) -> dict:
    """Each tensor's ``rel_diff``. A key with a ``<key>_scale`` in ``expected`` is measured against that scale: a
    sum whose terms cancel (a loss of 0.54 from terms of 86 in all) carries their rounding (~86 x 6e-8 in fp32,
    x the CPU's reduction order) in its last digits, which relative to 0.54 is 1e-5 and more."""
    return {k: rel_diff(v, expected[k], expected.get(f"{k}_scale")) for k, v in actual.items()}


def assert_rank_within_tolerance(results: dict, minimum: int) -> None:
    """``results``: {"case/dtype/tensor": rel diff} from one rank; at least ``minimum`` checks, none over TOL."""
    assert len(results) >= minimum, len(results)
    bad = {k: d for k, d in results.items() if d > TOL[getattr(torch, k.split("/")[1])]}
    assert not bad, bad
