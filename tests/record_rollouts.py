"""``gspo-megatron`` with every rank's rollout batch recorded, for tests that check what the trainer received.

    torchrun --nproc-per-node 4 -m tests.record_rollouts train cfg.yaml ...   (RECORD_ROLLOUTS=<dir>)

writes ``<dir>/rank{r}_step{s}.pt``: the batch's input_ids, loss_mask, prompt and response lengths, and the
samples' turns, as the loop hands them to the update.
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
    record = {k: rollout.batch[k] for k in ("input_ids", "loss_mask", "prompt_lengths", "response_lengths")}
    record["turns"] = [s.turns for s in rollout.samples]
    torch.save(record, Path(os.environ["RECORD_ROLLOUTS"]) / f"rank{dist.get_rank()}_step{step}.pt")
    return rollout


broadcast.collect = collect  # the loop calls broadcast.collect

if __name__ == "__main__":
    sys.exit(cli.main())
