"""``gspo-megatron`` with every rank's rollout recorded, or replayed, for tests that check what the trainer received
or compare two runs on the same rollouts.

    torchrun --nproc-per-node 4 -m tests.record_rollouts train cfg.yaml ...   (RECORD_ROLLOUTS=<dir>)

writes ``<dir>/rank{r}_step{s}.rollout.pt``: the whole ``Rollout`` (its batch and samples, as the loop hands them to
the update). With ``REPLAY_ROLLOUTS=<dir>`` (a recorded run's directory) each step still generates as usual (the
servers, the colocation's release and resume, the weight sync all run) and the update then receives the recorded
step's ``Rollout`` instead: SGLang samples from its scheduler's RNG unless launched with deterministic inference, so
two launches draw other tokens whenever their requests are batched differently (seen on a quiet machine too), and
a comparison of two runs' updates needs the same rollouts by construction.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron import cli
from gspo_megatron.train.sampling import broadcast

_collect = broadcast.collect


def collect(sampler, prompts, step, *args, **kwargs):
    rollout = _collect(sampler, prompts, step, *args, **kwargs)
    name = f"rank{dist.get_rank()}_step{step}"
    if os.environ.get("REPLAY_ROLLOUTS"):
        return torch.load(Path(os.environ["REPLAY_ROLLOUTS"]) / f"{name}.rollout.pt", weights_only=False)
    torch.save(rollout, Path(os.environ["RECORD_ROLLOUTS"]) / f"{name}.rollout.pt")
    return rollout


broadcast.collect = collect  # the loop calls broadcast.collect

if __name__ == "__main__":
    sys.exit(cli.main())
