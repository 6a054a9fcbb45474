"""Helpers of the rollout tests: trainer-side log-probs (the fused op fed with a transformers model's final hidden
states), prompts, and the sglang requirement."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

from gspo_megatron.ops import vocab_parallel_logprobs

TOLERANCE = 1e-3  # fp32 on CPU: max |trainer - SGLang| per token (measured ~1e-6)


def fused_logprobs(model, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """log pi(labels) [B, S] through ``ops.vocab_parallel_logprobs`` (post-norm hidden states, lm_head rows)."""
    out = model(batch["input_ids"], output_hidden_states=True)
    hidden = out.hidden_states[-1]  # after the final norm: the output layer's input
    B, S, H = hidden.shape
    lp = vocab_parallel_logprobs(hidden.reshape(B * S, H), model.lm_head.weight, batch["labels"].reshape(-1),
                                 temperature=temperature)
    return lp.view(B, S)


def prompts(count: int, seed: int = 0, lo: int = 3, hi: int = 9) -> list[list[int]]:
    """Prompts of distinct lengths where possible (so a wrong order shows up in the lengths too)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        length = lo + (i % (hi - lo + 1))
        out.append(torch.randint(3, 99, (length,), generator=g).tolist())
    return out


SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None


def require_sglang() -> None:
    """Skip without sglang, except under CI=true, where a missing sglang fails: CI must run these tests."""
    if SGLANG_INSTALLED:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("sglang is not importable but CI=true: tools/install.sh must install it, the rollout tests "
                    "need a real SGLang server", pytrace=False)
    pytest.skip("sglang is not installed: run `bash tools/install.sh`")


def import_from_cpu_site(module: str):
    """A module of ``patches/sglang_cpu/site`` (the CPU server's stand-ins), imported here as the server imports it:
    with that folder leading sys.path, for the import only."""
    from patches import sglang_cpu

    sys.path.insert(0, str(sglang_cpu.SITE))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(sglang_cpu.SITE))
