"""Rank 0's rollout delivered to every rank: the step's ``Rollout``, identical everywhere.

Whenever the other ranks wait for rank 0's work alone (a rollout, an eval) they wait in the control group
(``parallel.control``: gloo, with ``distributed.control_timeout_s``), never in an NCCL collective whose watchdog
would abort a long rollout. A rollout server restarted without the current weights (they came by distributed sync)
makes every rank sync again and rank 0 work again (``on_rank0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gspo_megatron.parallel import control
from gspo_megatron.rollout import RewardError, StaleWeights, samples_to_batch
from gspo_megatron.train.sampling.rounds import Redraw, RolloutPayload, Sampler, eval_metrics, produce
from gspo_megatron.train.startup.data import Prompt


@dataclass
class Rollout:
    """One step's rollout, identical on every rank. Samples are prompt-major: G per prompt."""

    samples: list
    rewards: torch.Tensor  # [N] float32
    reward_valid: torch.Tensor  # [N] bool (False: the reward, or the segment reward, failed and was masked)
    batch: dict  # samples_to_batch(...): input_ids, labels, loss_mask, rollout_logprobs [N, S]
    metrics: dict
    segments: list | None = None  # per sample [(end, reward), ...] with algo.token_advantages=segments
    # [N] int64: the trainer's weight version the engine served when the sample's generation started (its first
    # tokens'; under rollout.mode=async a sample in flight across a sync has later tokens from newer versions).
    versions: torch.Tensor | None = None


def collect(sampler: Sampler, prompts: list[Prompt], step: int, pad_multiple: int, more_prompts=None,
            version: int = 0, resync=None, partial=None) -> Rollout:
    """Rank 0 generates and scores with ``sampler`` (``rounds.produce``), everyone receives: a collective (the
    others wait in the control group).

    ``more_prompts(count)``: further prompts for rollout.filter_zero_variance_groups (the prompt stream's
    ``next``); every rank calls it for as many prompts as rank 0 drew, so data positions stay equal.
    ``resync()``: the weight sync (collective), for a rollout server restarted without the current weights (they
    came by distributed sync): every rank syncs and rank 0 generates the step again (``on_rank0``).
    ``partial``: rank 0's ``PartialRollouts`` (rollout.partial_chunk_tokens); an attempt generated again starts
    from the groups in flight as the step began (the failed attempt's chunks are dropped)."""
    more = Redraw(more_prompts) if more_prompts is not None else None
    before = partial.state_dict() if partial is not None else None

    def retry():
        if more is not None:
            more.rewind()
        if partial is not None:
            partial.load_state_dict(before)

    payload = on_rank0(lambda: produce(sampler, prompts, step, more, version, partial), resync, retry=retry)
    return as_rollout(payload, pad_multiple, more_prompts)


def as_rollout(payload: RolloutPayload, pad_multiple: int, more_prompts=None) -> Rollout:
    """Every rank's Rollout of rank 0's ``produce`` payload (received)."""
    p = payload
    if dist.get_rank() != 0 and p.extra_prompts:
        more_prompts(p.extra_prompts)  # rank 0 drew these: keep every rank's data position the same
    batch = samples_to_batch(p.samples, pad_id=0, pad_to_multiple=pad_multiple)
    versions = (torch.tensor(p.versions) if isinstance(p.versions, list)
                else torch.full((len(p.samples),), p.versions))
    return Rollout(p.samples, p.rewards, p.reward_valid, batch, p.metrics, p.segments, versions)


def on_rank0(work, resync=None, retry=None):
    """``work()`` on rank 0, its result on every rank (collective). If a rollout server was restarted without the
    current weights (``StaleWeights``: they came by distributed sync), every rank calls ``resync()`` and rank 0
    works again (after ``retry()``); without ``resync`` the error is raised. A ``RewardError`` is raised on every
    rank."""
    while True:
        payload = None
        if dist.get_rank() == 0:
            try:
                payload = ("done", work())
            except StaleWeights as e:
                if resync is None:
                    raise
                print(f"{e}: syncing the weights again, then generating again", flush=True)
                payload = ("resync", None)
            except RewardError as e:  # every rank stops with the reward's error (not waiting for a broadcast)
                payload = ("error", e)
        kind, result = control.broadcast_from_rank0(payload)
        if kind == "done":
            return result
        if kind == "error":
            raise result
        resync()
        if retry is not None:
            retry()


def evaluate(sampler: Sampler, prompts: list[Prompt], step: int, resync=None) -> dict:
    """Mean reward of one response per held-out prompt (rank 0; others get the numbers by broadcast).
    ``resync``: as ``collect``'s."""
    return on_rank0(lambda: eval_metrics(sampler, prompts, step), resync)
