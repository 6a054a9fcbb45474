"""Rank 0's generation rounds: generate G responses per prompt, score them, screen degenerate ones, and with
``rollout.filter_zero_variance_groups`` (DAPO's dynamic sampling) drop groups without reward variance and sample
more prompts, for at most ``rollout.max_sampling_rounds`` rounds. ``produce`` returns the step's ``RolloutPayload``.
What every round uses and a run never changes (the engine, the config, the tokenizer, the reward functions) is one
``Sampler``, built once by the rollout source; the rounds take it, the step's prompts and the step.

No collective here: rank 0 runs this on the caller's thread (sync) or on the rollout source's background thread
(``source.py``), which talks only to the servers (HTTP) and the reward workers; ``broadcast.py`` delivers the payload
to every rank.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gspo_megatron.rewards import score
from gspo_megatron.rewards.multiturn import TurnLimits, generate_trajectories, load_env, turn_metrics
from gspo_megatron.rewards.rewards import score_segments
from gspo_megatron.rollout import LocalEngine, SamplingParams
from gspo_megatron.train.resilience import fault_injection
from gspo_megatron.train.startup.bootstrap import reward_function
from gspo_megatron.train.startup.config import Config
from gspo_megatron.train.startup.data import Prompt


@dataclass
class Sampler:
    """What every generation round of a run uses: rank 0's engine (None on the other ranks), the config, the
    tokenizer and the reward function, and with ``algo.token_advantages=segments`` the segment reward
    (``bootstrap.reward_function(segments=True)``), built here once so that its worker pool serves every step."""

    engine: Any
    cfg: Config
    tokenizer: Any
    reward_fn: Callable
    segment_reward_fn: Callable | None = None

    def __post_init__(self):
        if self.segment_reward_fn is None and self.cfg.algo.token_advantages == "segments":
            self.segment_reward_fn = reward_function(self.cfg, segments=True)


@dataclass
class RolloutPayload:
    """Rank 0's rollout of one step as it travels to every rank (``broadcast.as_rollout`` makes it each rank's
    ``Rollout``). Samples are prompt-major: G per prompt."""

    samples: list
    rewards: torch.Tensor  # [N] float32
    reward_valid: torch.Tensor  # [N] bool (False: masked: a failed reward or segment reward, a masked truncation)
    metrics: dict
    segments: list | None  # per sample [(end, reward), ...] with algo.token_advantages=segments or turns
    extra_prompts: int  # prompts rank 0 drew past the step's first ones: every other rank draws as many
    # The trainer's weight version the engine served as generation started; per sample (its oldest token's) with
    # partial rollouts.
    versions: int | list[int]


class Redraw:
    """Rank 0's ``more_prompts`` across attempts at a step: an attempt after a resync gets the prompts the earlier
    one drew (in order) before new ones; ``prompts`` holds everything the stream gave."""

    def __init__(self, more_prompts):
        self.more_prompts, self.prompts, self.used = more_prompts, [], 0

    def __call__(self, count: int) -> list:
        if self.used + count > len(self.prompts):
            self.prompts += self.more_prompts(self.used + count - len(self.prompts))
        self.used += count
        return self.prompts[self.used - count:self.used]

    def rewind(self) -> None:
        self.used = 0


def sampling_params(cfg: Config, step: int, eos_ids, sampling_round: int = 0):
    r = cfg.rollout
    seed = cfg.train.seed * 100_003 + step + 1_000_003 * sampling_round
    stops = tuple(dict.fromkeys(list(eos_ids) + list(r.stop_token_ids)))
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          stop_token_ids=stops, seed=seed)


def _generate_and_score(sampler: Sampler, prompts: list[Prompt], step: int, n: int, sampling_round: int = 0):
    """(samples, Rewards, response texts, generation seconds) of n responses per prompt."""
    cfg, tokenizer = sampler.cfg, sampler.tokenizer
    if cfg.rollout.env:  # multi-turn: the environment's turn rewards instead of reward_fn
        return _trajectories(sampler, prompts, step, n, sampling_round)
    start = time.perf_counter()
    groups = sampler.engine.generate([p.ids for p in prompts], n,
                                     sampling_params(cfg, step, [tokenizer.eos_token_id], sampling_round))
    seconds = time.perf_counter() - start
    samples = [s for g in groups for s in g.samples]
    return (samples, *_score_samples(sampler, samples, prompts), seconds)


def _score_samples(sampler: Sampler, samples, prompts: list[Prompt]) -> tuple:
    """(Rewards, response texts) of samples generated for ``prompts`` (``Sample.prompt_index`` into them)."""
    labels = [prompts[s.prompt_index].label for s in samples]
    prompt_texts = [prompts[s.prompt_index].text for s in samples]
    responses = [s.text if s.text is not None else sampler.tokenizer.decode(s.response_ids, skip_special_tokens=True)
                 for s in samples]
    rewards = score(sampler.reward_fn, samples, labels, prompt_texts, responses,
                    on_error=sampler.cfg.data.on_reward_error)
    return rewards, responses


def _trajectories(sampler: Sampler, prompts: list[Prompt], step: int, n: int, sampling_round: int = 0):
    """n multi-turn trajectories per prompt with rollout.env (``rewards.multiturn``); same results as above."""
    cfg, engine, tokenizer = sampler.cfg, sampler.engine, sampler.tokenizer
    r = cfg.rollout
    concurrency = 1 if isinstance(engine, LocalEngine) else r.env_concurrency  # the local engine: one at a time
    limits = TurnLimits(r.max_turns, r.max_trajectory_tokens, concurrency)
    start = time.perf_counter()
    sampling = sampling_params(cfg, step, [tokenizer.eos_token_id], sampling_round)
    groups, rewards = generate_trajectories(engine, prompts, n, sampling,
                                            load_env(r.env), tokenizer, limits, cfg.data.on_reward_error, r.env_args)
    samples = [s for g in groups for s in g.samples]
    return samples, rewards, [s.text for s in samples], time.perf_counter() - start


def _segment_rewards(sampler: Sampler, samples, prompts: list[Prompt]):
    """Per-segment rewards (algo.token_advantages=segments): ([(end, reward), ...] per sample, valid [N])."""
    tokens = [[sampler.tokenizer.decode([t], skip_special_tokens=True) for t in s.response_ids] for s in samples]
    return score_segments(sampler.segment_reward_fn, samples, [prompts[s.prompt_index].label for s in samples],
                          [prompts[s.prompt_index].text for s in samples], tokens,
                          on_error=sampler.cfg.data.on_reward_error)


def screen_responses(samples, on_truncated: str) -> tuple[torch.Tensor, dict]:
    """What a step does with degenerate responses -> (kept [N] bool, counts as metrics).

    Cut at max_new_tokens (finish_reason length): trained with its reward (``rollout.on_truncated=keep``), or not
    kept (``mask``: out of the loss and of its group's mean and std, as a failed reward). Empty (no token: an engine
    that stopped before the first): kept, its reward counts in its group's statistics, and it has no token to put
    in the loss (``samples_to_batch`` masks the whole row)."""
    truncated = torch.tensor([s.finish_reason == "length" for s in samples], dtype=torch.bool)
    empty = sum(not s.response_ids for s in samples)
    kept = ~truncated if on_truncated == "mask" else torch.ones_like(truncated)
    return kept, {"responses_truncated": float(truncated.sum()), "responses_empty": float(empty),
                  "truncated_masked": float((~kept).sum())}



def _round(sampler: Sampler, prompts: list[Prompt], step: int, sampling_round: int) -> dict:
    """One generation round on rank 0: samples, rewards, validity (and segment rewards) of ``prompts``."""
    samples, rewards, responses, seconds = _generate_and_score(
        sampler, prompts, step, sampler.cfg.rollout.group_size, sampling_round)
    return _round_data(sampler, samples, rewards, responses, seconds, prompts)


def _round_data(sampler: Sampler, samples, rewards, responses, seconds: float, prompts: list[Prompt]) -> dict:
    """A round's samples and rewards with their validity, segment rewards and response counts."""
    cfg = sampler.cfg
    segments, valid = None, rewards.valid
    if cfg.algo.token_advantages == "segments":
        segments, segments_valid = _segment_rewards(sampler, samples, prompts)
        valid = valid & segments_valid
    elif cfg.algo.token_advantages == "turns":  # multi-turn: each turn a segment with its reward
        segments = [s.turns for s in samples]
    kept, response_metrics = screen_responses(samples, cfg.rollout.on_truncated)
    return {"samples": samples, "values": rewards.values, "valid": valid & kept, "segments": segments,
            "seconds": seconds, "responses": responses, "prompts": prompts, "response_metrics": response_metrics,
            "reward_valid": rewards.valid, "reward_timeouts": rewards.timed_out, "reward_crashes": rewards.crashed}


def uniform_groups(values: torch.Tensor, valid: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] bool: groups whose valid rewards are all equal (or fewer than two valid): zero advantage."""
    v, ok = values.view(-1, group_size), valid.view(-1, group_size)
    high = torch.where(ok, v, torch.full_like(v, -torch.inf)).amax(dim=1)
    low = torch.where(ok, v, torch.full_like(v, torch.inf)).amin(dim=1)
    return (ok.sum(dim=1) < 2) | (high == low)


def _rounds(sampler: Sampler, prompts: list[Prompt], step: int, more_prompts) -> tuple:
    """Rank 0's rounds: one, or with rollout.filter_zero_variance_groups (DAPO's dynamic sampling) more prompts
    until ``prompts_per_step`` groups with reward variance are in hand or ``max_sampling_rounds`` rounds ran.
    Returns (the kept groups' round data, all rounds' data, sampling metrics, extra prompts drawn)."""
    r = sampler.cfg.rollout
    rounds = [_round(sampler, prompts, step, 0)]
    if not r.filter_zero_variance_groups:
        return rounds[0], rounds, {}, 0
    G, want, extra = r.group_size, r.prompts_per_step, 0
    kept, dropped = [], []  # (round, group) of groups with and without signal
    while True:
        data = rounds[-1]
        uniform = uniform_groups(data["values"], data["valid"], G).tolist()
        kept += [(len(rounds) - 1, g) for g, u in enumerate(uniform) if not u]
        dropped += [(len(rounds) - 1, g) for g, u in enumerate(uniform) if u]
        if len(kept) >= want or len(rounds) == r.max_sampling_rounds or more_prompts is None:
            break
        # Oversample by the rate groups were kept so far (DAPO), at most a full step's prompts.
        keep_rate = max(len(kept), 1) / (len(kept) + len(dropped))
        count = min(want, math.ceil((want - len(kept)) / keep_rate))
        extra += count
        rounds.append(_round(sampler, more_prompts(count), step, len(rounds)))
    chosen = kept[:want] + dropped[:max(0, want - len(kept))]
    chosen.sort()
    metrics = {"sampling/groups_dropped": float(len(dropped)), "sampling/rounds": float(len(rounds)),
               "sampling/prompts": float(want + extra),
               "sampling/uniform_groups_kept": float(max(0, want - len(kept)))}
    picked = {"samples": [], "values": [], "valid": [], "segments": [] if rounds[0]["segments"] is not None else None,
              "responses": [], "prompts": []}
    for i, g in chosen:
        data, rows = rounds[i], slice(g * G, (g + 1) * G)
        picked["samples"] += data["samples"][rows]
        picked["responses"] += data["responses"][rows]
        picked["values"].append(data["values"][rows])
        picked["valid"].append(data["valid"][rows])
        picked["prompts"].append(data["prompts"][g])
        if picked["segments"] is not None:
            picked["segments"] += data["segments"][rows]
    picked["values"], picked["valid"] = torch.cat(picked["values"]), torch.cat(picked["valid"])
    return picked, rounds, metrics, extra


def produce(sampler: Sampler, prompts: list[Prompt], step: int, more_prompts=None, version: int = 0,
            partial=None) -> RolloutPayload:
    """Rank 0's side of ``collect``: generate, score, and the payload every rank receives; ``version``: the weights
    the engine serves as generation starts. No collective: the rollout source (``source.py``) runs it
    on a background thread, which talks only to the servers (HTTP) and the reward workers. ``partial``: rank 0's
    ``PartialRollouts`` (``rollout.partial_chunk_tokens``), which draws every prompt through ``more_prompts``."""
    cfg, engine = sampler.cfg, sampler.engine
    fault_injection.at("rollout", step, engine)  # the soak run's schedule (GSPO_FAULTS); nothing otherwise
    if partial is not None:  # the groups completed this step, some begun in earlier steps under older weights
        sampling = sampling_params(cfg, step, [sampler.tokenizer.eos_token_id])
        samples, chosen, seconds, extra, sampling_metrics = partial.step(engine, more_prompts, sampling, version)
        rewards, responses = _score_samples(sampler, samples, chosen)
        picked = _round_data(sampler, samples, rewards, responses, seconds, chosen)
        rounds = [picked]
        version = [min(s.token_versions, default=version) for s in samples]  # each sample's oldest token's
    else:
        picked, rounds, sampling_metrics, extra = _rounds(sampler, prompts, step, more_prompts)
    if isinstance(more_prompts, Redraw):  # every prompt rank 0 drew, over all attempts at the step
        extra = len(more_prompts.prompts)
    # Reward statistics over everything sampled (the policy's, not the filtered batch's).
    values = torch.cat([d["values"] for d in rounds])
    valid = torch.cat([d["reward_valid"] for d in rounds])  # truncated responses masked from the loss count here
    lengths = [len(s.response_ids) for d in rounds for s in d["samples"]]
    counts = {k: float(sum(d["response_metrics"][k] for d in rounds)) for k in rounds[0]["response_metrics"]}
    metrics = {
        "reward_mean": float(values[valid].mean()) if valid.any() else float("nan"),
        "reward_masked": float((~picked["valid"]).sum()),
        "reward_timeouts": float(sum(d["reward_timeouts"] for d in rounds)),
        "reward_crashes": float(sum(d["reward_crashes"] for d in rounds)),
        **counts,
        "response_length_mean": sum(lengths) / len(lengths),
        "truncated_frac": counts["responses_truncated"] / len(lengths),
        # Groups whose responses all score the same have zero advantage: no learning signal from them.
        "groups_zero_advantage": float((values.view(-1, cfg.rollout.group_size).std(dim=1) == 0)
                                       .float().mean()),
        "time/rollout": sum(d["seconds"] for d in rounds),
        "example": f"{picked['prompts'][0].text!r} -> {picked['responses'][0]!r}",
        **sampling_metrics,
    }
    if cfg.rollout.env:
        metrics.update(turn_metrics([s for d in rounds for s in d["samples"]]))
    metrics.update(engine.fault_metrics() if hasattr(engine, "fault_metrics") else {})
    return RolloutPayload(picked["samples"], picked["values"], picked["valid"], metrics, picked["segments"], extra,
                          version)


def eval_metrics(sampler: Sampler, prompts: list[Prompt], step: int) -> dict:
    """Rank 0's side of ``evaluate`` (no collective)."""
    _, rewards, _, seconds = _generate_and_score(sampler, prompts, -step, 1)
    return {"eval_reward_mean": float(rewards.values[rewards.valid].mean()), "time/eval": seconds}
