"""The rollout interface: every engine turns prompts into groups of sampled responses with their log-probs.

    engine.generate(prompts, n, sampling) -> list[Group]     one Group per prompt, in prompt order,
                                                              each holding n Samples
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import torch

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled. Log-probs are always of the *temperature-scaled* distribution,
    log softmax(logits / temperature), before top-p / top-k filtering (SGLang's convention), so the trainer
    computes the same quantity with ``temperature`` (``LossConfig.temperature``)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filtering
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  # SGLang's per-request sampling_seed (reproducible sampling)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens} must be >= 1")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"sampling.temperature={self.temperature} must be a finite number > 0 (RL needs the sampled "
                "tokens' log-probs; use a small temperature such as 1e-3 for near-greedy decoding)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling.top_k={self.top_k} must be -1 (off) or >= 1")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"sampling.min_p={self.min_p} must be in [0, 1)")

    def to_sglang(self, n: int) -> dict:
        params = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "n": n,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            params["sampling_seed"] = int(self.seed)
        return params


@dataclass
class Sample:
    """One sampled response. ``logprobs[j]`` is log pi(response_ids[j] | prompt, response[:j]) under the weights
    of ``weight_version``, temperature-scaled (see ``SamplingParams``)."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS / stop token, included in response_ids) or "length"
    weight_version: str
    prompt_index: int = 0  # position of the prompt in the generate() call
    sample_index: int = 0  # 0..n-1 within its group
    text: str | None = None  # the decoded response, when the engine has a tokenizer
    # The experts the engine routed each token to (rollout routing replay; SGLang's meta_info "routed_experts"):
    # [P + R - 1, layers, top-k] int16, row t for the token at position t of prompt + response (the last token is
    # never forwarded: it has no row). The trainer's batch key of the same name stacks them (``rollout.batch``).
    rollout_routing: torch.Tensor | None = None
    # Multi-turn trajectories (``rewards.multiturn``): response_ids holds the model's turns and the environment's
    # observations in order; response_mask[j] is True where the model sampled response_ids[j] (only those carry a
    # log-prob, a loss and an advantage; observation positions have logprobs 0). None: every token is the model's.
    response_mask: list[bool] | None = None
    # Per turn (end, reward): end counts the response tokens up to and including the turn's last model token (the
    # segments of ``algo.token_advantages=turns``); None for single-turn samples.
    turns: list[tuple[int, float]] | None = None
    # Partial rollouts (``train.sampling.partial_rollouts``): the trainer's weight version that sampled each response token
    # (a sample continued across steps spans several); None: every token is ``weight_version``'s.
    token_versions: list[int] | None = None

    def __post_init__(self):
        if self.token_versions is not None and len(self.token_versions) != len(self.response_ids):
            raise ValueError(f"sample (prompt {self.prompt_index}, sample {self.sample_index}): token_versions of "
                             f"{len(self.token_versions)} for {len(self.response_ids)} response tokens")
        if self.response_mask is not None and len(self.response_mask) != len(self.response_ids):
            raise ValueError(f"sample (prompt {self.prompt_index}, sample {self.sample_index}): response_mask of "
                             f"{len(self.response_mask)} for {len(self.response_ids)} response tokens")
        if self.rollout_routing is not None:
            expected = len(self.prompt_ids) + len(self.response_ids) - 1
            if self.rollout_routing.dim() != 3 or self.rollout_routing.shape[0] != expected:
                raise ValueError(
                    f"sample (prompt {self.prompt_index}, sample {self.sample_index}): rollout_routing of shape "
                    f"{tuple(self.rollout_routing.shape)}, expected [{expected}, layers, top-k] (prompt "
                    f"{len(self.prompt_ids)} + response {len(self.response_ids)} tokens - 1)"
                )
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"sample (prompt {self.prompt_index}, sample {self.sample_index}): {len(self.response_ids)} "
                f"response tokens but {len(self.logprobs)} log-probs"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"sample (prompt {self.prompt_index}, sample {self.sample_index}): finish_reason "
                f"{self.finish_reason!r} is not one of {FINISH_REASONS}"
            )

    @property
    def name(self) -> str:
        return f"prompt {self.prompt_index}, sample {self.sample_index}"

    def logprobs_tensor(self) -> torch.Tensor:
        return torch.tensor(self.logprobs, dtype=torch.float32)

    def mask_tensor(self) -> torch.Tensor:
        """[R] bool: the response tokens the model sampled (all of them for a single-turn sample)."""
        if self.response_mask is None:
            return torch.ones(len(self.response_ids), dtype=torch.bool)
        return torch.tensor(self.response_mask, dtype=torch.bool)


@dataclass
class Group:
    """The n responses sampled for one prompt (GSPO's group: advantages are normalised within it)."""

    prompt_index: int
    prompt_ids: list[int]
    samples: list[Sample] = field(default_factory=list)


@dataclass(frozen=True)
class SyncStats:
    """What one weight update moved and how long it took."""

    method: str  # "distributed" or "disk"
    weight_version: str
    seconds: float
    num_tensors: int
    num_bytes: int
    num_buckets: int
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase (pack, broadcast, ...), if timed

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-9) / 1e9

    def metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        return {
            f"{prefix}seconds": self.seconds,
            f"{prefix}gb": self.num_bytes / 1e9,
            f"{prefix}gb_per_s": self.gb_per_s,
            f"{prefix}tensors": float(self.num_tensors),
            f"{prefix}buckets": float(self.num_buckets),
            **{f"{prefix}{name}_seconds": value for name, value in self.phases.items()},
        }


NamedTensors = Iterable[tuple[str, torch.Tensor]]


class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine (``SGLangEngine``, ``LocalEngine``)."""

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> list[Group]: ...

    def update_weights(self, named_tensors: NamedTensors, version: str) -> SyncStats: ...

    def weight_version(self) -> str: ...

    def close(self) -> None: ...


def check_prompts(prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """Prompts as lists of ints; raises naming the first bad one."""
    if n < 1:
        raise ValueError(f"n={n} responses per prompt must be >= 1")
    out = []
    for i, p in enumerate(prompts):
        ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if min(ids) < 0:
            raise ValueError(f"prompt {i} has a negative token id {min(ids)}")
        out.append(ids)
    if not out:
        raise ValueError("generate() got no prompts")
    return out


def flatten(groups: Sequence[Group]) -> list[Sample]:
    """Samples prompt-major (group 0's n samples, then group 1's, ...), the order advantages expect."""
    return [s for g in groups for s in g.samples]
