"""The tool-use example (examples/tool_use_cpu.yaml: the tiny MoE with a calculator, real SGLang server on
127.0.0.1), briefly: learning is shown by the full run, whose numbers and plot are in docs/examples.md.

Under torchrun at TP=2 x EP=2 every rank's batch must hold the trajectories as the engine and the calculator made
them: the model's turns trained, each calculator result in the sequence with no loss on it and equal to the call's
value; from step 1 the warm-started policy calls the tool. (The loop's multi-turn rollouts at world 1:
tests/train/sampling/test_multiturn.py.)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from gspo_megatron.rewards.multiturn import _CALC, format_number, safe_eval
from gspo_megatron.rewards.synthetic import char_tokenizer
from gspo_megatron.rewards.tool_calls import calculator_observation
from tests import warm_cli
from tests.rollout.helpers import require_sglang

pytestmark = pytest.mark.megatron  # trains the Megatron policy through the CLI

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/tool_use_cpu.yaml"
# A shorter warm start than the example's 200 steps: the policy still calls the calculator in about half its
# trajectories, and the test spends its time on the loop.
QUICK = ["model.warm_start_steps=120", "rollout.group_size=4", "rollout.prompts_per_step=8",
         "parallel.micro_batch_size=8", "train.eval_every=2", "checkpoint.every=0"]


def _warm_model(path: Path) -> None:
    """The example's tiny model warm-started as the trainer builds it (``bootstrap.build_tiny_model``, the QUICK
    settings), at ``model.hf_dir``, where the trainer then finds it."""
    from gspo_megatron.train.startup.bootstrap import build_tiny_model
    from gspo_megatron.train.startup.config import load_config

    build_tiny_model(load_config(str(CONFIG), QUICK), path)


def _run(tmp_path, steps: int, launcher: list[str], overrides: list[str], env: dict) -> list[dict]:
    """``launcher train examples/tool_use_cpu.yaml`` for ``steps`` steps -> its metrics records."""
    cmd = [*launcher, "train", str(CONFIG), f"train.steps={steps}", *QUICK, *overrides,
           f"model.hf_dir={tmp_path / 'model'}", f"logging.dir={tmp_path}", f"checkpoint.dir={tmp_path / 'ck'}",
           f"logging.plot_every={steps}"]
    out = warm_cli.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    return records


def _check_sane(records: list[dict]) -> None:
    for r in records:
        numbers = {k: v for k, v in r.items() if isinstance(v, (int, float))}
        assert all(math.isfinite(v) for v in numbers.values()), [k for k, v in numbers.items() if not math.isfinite(v)]
        assert 0 <= r["reward_mean"] <= 1 and 1 <= r["turns_mean"] <= 3 and 0 < r["observed_frac"] <= 1, r
        assert r["observation_tokens_mean"] > 0 and r["entropy"] > 0 and 0 <= r["clip_frac_seqs"] <= 1, r
        # The trainer's log-probs of the model's tokens equal SGLang's (after step 1: with synced weights).
        assert r["logprob_diff_max"] < 1e-4, r["logprob_diff_max"]
    assert all(0 <= r["eval_reward_mean"] <= 1 for r in records if r["step"] % 2 == 0)


def _spans(mask: list[bool]) -> list[tuple[bool, int, int]]:
    """Runs of equal values: [(value, start, end)]."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def _check_trajectories(rollout, tokenizer) -> int:
    """Every observation is the calculator's answer to the turn before it, masked; returns how many trajectories
    called the calculator."""
    calls, batch = 0, rollout.batch
    for b in range(len(batch["input_ids"])):
        P, R = int(batch["prompt_lengths"][b]), int(batch["response_lengths"][b])
        ids = batch["input_ids"][b].tolist()
        mask = batch["loss_mask"][b].tolist()  # position t predicts token t + 1
        assert not any(mask[:P - 1]) and not any(mask[P + R - 1:]), "only response tokens carry loss"
        response_mask = mask[P - 1:P + R - 1]
        text = lambda lo, hi: tokenizer.decode(ids[P + lo:P + hi], skip_special_tokens=True)  # noqa: E731
        spans = _spans(response_mask)
        assert spans[0][0], "a trajectory starts with a model turn"
        assert len([s for s in spans if s[0]]) == len(rollout.samples[b].turns)  # turns end where observations start
        for (trained, lo, hi), previous in zip(spans[1:], spans):
            if trained:
                continue
            expression = _CALC.findall(text(previous[1], previous[2]))[-1]
            try:
                value = format_number(safe_eval(expression))
            except (ValueError, ZeroDivisionError, OverflowError):
                value = None
            observed = text(lo, hi)
            assert observed == calculator_observation(value) if value is not None else observed.startswith(
                "<result>error: "), (text(0, R), observed)
        calls += any(not trained for trained, _, _ in spans)
    return calls


def test_tool_use_example_under_torchrun_tp2_ep2(tmp_path):
    require_sglang()
    _warm_model(tmp_path / "model")
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    (tmp_path / "rollouts").mkdir()
    # One torch thread per rank: four ranks and the server share the machine's cores.
    env = dict(os.environ, OMP_NUM_THREADS="1", RECORD_ROLLOUTS=str(tmp_path / "rollouts"))
    records = _run(tmp_path, 3, [torchrun, "--standalone", "--nproc-per-node", "4", "-m", "tests.record_rollouts"],
                   ["parallel.tensor=2", "parallel.expert=2"], env)
    _check_sane(records)
    assert all(r["weight_sync/tensors"] > 0 for r in records)
    tokenizer = char_tokenizer(128)
    for step in (1, 2, 3):
        rollouts = [torch.load(tmp_path / "rollouts" / f"rank{rank}_step{step}.rollout.pt", weights_only=False)
                    for rank in range(4)]
        for other in rollouts[1:]:  # every rank trains on rank 0's rollout
            assert all(torch.equal(other.batch[k], rollouts[0].batch[k]) for k in ("input_ids", "loss_mask"))
        calls = _check_trajectories(rollouts[0], tokenizer)
        assert calls == round(records[step - 1]["observed_frac"] * len(rollouts[0].batch["input_ids"])) > 0
    # The warm start's demonstrations taught it to call the calculator and copy the result: a signal from step 1.
    assert records[0]["observed_frac"] > 0.25 and records[0]["reward_mean"] > 0.05, records[0]
    assert (tmp_path / "ck" / "latest").read_text() == "step_000003"
