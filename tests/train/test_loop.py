"""The trainer end to end (local engine, world=1): metrics, plots, checkpoints, and exact resume after SIGKILL in step 3
(the uninterrupted run saves asynchronously, the resumed one synchronously: the final weights are bit-identical).

The SGLang path of the same loop is tested in tests/rollout (server on loopback) and by the CPU example.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.train.resilience import fault_injection
from tests import warm_cli
from tests.train.saved import final_weights

pytestmark = pytest.mark.megatron  # trains the Megatron policy through the CLI

ROOT = Path(__file__).resolve().parents[2]
# The rollout schedules' tests build and train the policy with the calls of the plain run's test, which runs on
# megatron-core 0.19 too; what they add (versions, staleness, carried samples) is the loop's own.
SCHEDULE_ONLY = pytest.mark.megatron_covered_by("tests/train/test_loop.py::test_train_logs_plots_and_resumes_exactly")


def _command(run: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
            "rollout.engine=local", f"train.steps={steps}", "train.eval_every=2", "model.warm_start_steps=5",
            f"model.hf_dir={run.parent / 'model'}", f"logging.dir={run}", f"checkpoint.dir={run / 'ck'}",
            "checkpoint.every=2", "logging.plot_every=2", "rollout.prompts_per_step=4",
            "parallel.micro_batch_size=8", *extra]


def _train(run: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, WORLD_SIZE="1")
    out = warm_cli.run(_command(run, steps, *extra), capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_train_logs_plots_and_resumes_exactly(tmp_path):
    uninterrupted = tmp_path / "a"
    out = _train(uninterrupted, 3, "checkpoint.async_save=true")  # the resumed run below saves synchronously
    # Off a terminal (captured here, as in a log file) the progress is one line per step, not a bar's \r-joined one
    steps = [line for line in out.stderr.splitlines() if line.startswith("gspo step ")]
    assert [line.split(":")[0] for line in steps] == ["gspo step 1/3", "gspo step 2/3", "gspo step 3/3"], out.stderr
    assert "\r" not in out.stderr and all(" tokens/s" in line and "reward " in line for line in steps), steps
    records = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("reward_mean", "clip_frac", "seq_ratio_min", "seq_ratio_max", "approx_kl", "logprob_diff_max",
                "time/rollout", "time/old_logprobs", "time/update", "time/weight_sync", "tokens_per_s", "loss",
                "entropy", "groups_zero_advantage", "clip_frac_tokens", "clip_frac_seqs", "expert_volatility"):
        assert all(r.get(key) is not None for r in records), key
    # GSPO clips sequences: its clip fraction is the sequence one; one step changes some routing decisions' experts.
    assert all(r["clip_frac"] == r["clip_frac_seqs"] and 0 <= r["expert_volatility"] <= 1 for r in records)
    # Trainer and engine score the same tokens with the same weights (fp32): the gap is rounding only.
    assert max(r["logprob_diff_max"] for r in records) < 1e-4
    # Entropy per token lies in (0, log V]; a fraction of groups lies in [0, 1].
    assert all(0 < r["entropy"] <= math.log(128) and 0 <= r["groups_zero_advantage"] <= 1 for r in records)
    assert "eval_reward_mean" in records[1]
    assert (uninterrupted / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert (uninterrupted / "ck" / "latest").read_text() == "step_000003"

    # Same run, SIGKILLed as step 3's rollout starts (the fault schedule: at that point whatever the machine's load),
    # its step-2 checkpoint the latest, then resumed to the end.
    resumed = tmp_path / "b"
    scheduled = fault_injection.write(tmp_path / "faults.json",
                                      [{"at": "rollout", "step": 3, "action": "kill_rank", "rank": 0}])
    process = subprocess.Popen(_command(resumed, 3), cwd=ROOT, env=dict(os.environ, WORLD_SIZE="1", **scheduled),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert process.wait(timeout=600) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert (resumed / "ck" / "latest").read_text() == "step_000002"
    out = _train(resumed, 3, "--resume")
    assert f"gspo-megatron train: resumed from {resumed / 'ck' / 'step_000002'} at step 2 of 3" in out.stdout, out.stdout
    assert (resumed / "ck" / "latest").read_text() == "step_000003"

    (a, b), = run_on_ranks(final_weights, 1, None, str(uninterrupted / "ck" / "step_000003"),
                           str(resumed / "ck" / "step_000003"))
    assert a.keys() == b.keys() and len(a) > 10
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed weights differ from the uninterrupted run: {different[:5]}"

    # A run whose latest checkpoint is older than its last logged step (killed after logging step 3, before saving
    # it: here `latest` set back to step 2), resumed: metrics.jsonl holds each step once, the new step 3 in place.
    (uninterrupted / "ck" / "latest").write_text("step_000002")
    first = records[2]["time"]
    _train(uninterrupted, 3, "--resume", "checkpoint.every=0")
    again = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [1, 2, 3] and again[2]["time"] > first


def test_kl_penalty_runs_a_frozen_reference_pass(tmp_path):
    """algo.kl_coef > 0: a reference pass each step against the starting weights, logged as kl_ref; the padding
    share of padded and packed rows; rollout.stop_token_ids reach the engine."""
    # checkpoint.every_minutes (here: any time at all) saves each step, checkpoint.every=0 notwithstanding
    _train(tmp_path / "kl", 3, "algo.kl_coef=0.1", "checkpoint.every=0", "checkpoint.every_minutes=1e-6")
    records = [json.loads(line) for line in (tmp_path / "kl" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["time/ref_logprobs"] > 0 and r["time/checkpoint"] > 0 for r in records)
    assert sorted(p.name for p in (tmp_path / "kl" / "ck").glob("step_*")) == ["step_000002", "step_000003"]  # keep 2
    # Step 1 scores the rollout with the starting weights on both sides: KL is rounding only (fp32).
    assert abs(records[0]["kl_ref"]) < 1e-6
    # After updates the policy has moved from the reference, which itself stays put: KL grows from zero.
    assert records[1]["kl_ref"] > 1e-5 and records[2]["kl_ref"] > 1e-5
    assert all(r["padding_frac"] > 0 for r in records)  # padded rows: prompts and responses of several lengths
    # Without KL; and every token id a stop token (each response is its first token), packed rows, one trainer thread.
    without = tmp_path / "no_kl"
    _train(without, 1, "checkpoint.every=0", "train.eval_every=0", f"rollout.stop_token_ids={list(range(128))}",
           "parallel.pack_sequences=true", "train.cpu_threads=1")
    record = json.loads((without / "metrics.jsonl").read_text().splitlines()[0])
    assert "kl_ref" not in record
    assert record["response_length_mean"] == 1.0 and record["truncated_frac"] == 0.0
    assert record["padding_frac"] == 0.0


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_gspo_token_with_segment_rewards_on_the_rollout_logprobs_and_grpo_with_routing_replay(tmp_path):
    """GSPO-token with per-token advantages from per-segment rewards, taking pi_old from the engine: no old-policy
    pass (the mismatch is measured by the first update instead), with a geometric correction of the current policy
    against the engine's log-probs (verl's bypass mode); GRPO + Routing Replay, whose pass records the experts,
    with a token-level masked correction of that pass against the engine's. Both log their clip fraction per token,
    the paper's unit for token-level clipping, and what the correction did."""
    quick = ("checkpoint.every=0", "train.eval_every=0", "logging.plot_every=0")
    token = tmp_path / "gspo_token"
    _train(token, 2, "algo.name=gspo_token", "algo.token_advantages=segments", "data.segment_reward=synthetic",
           "rollout.reuse_rollout_logprobs=true", "correction.level=geometric", "correction.rejection=max",
           "correction.rejection_high=3", *quick)
    for r in _records(token):
        assert "time/old_logprobs" not in r and "entropy" not in r and "expert_volatility" not in r, sorted(r)
        # pi_old is the engine's: at unchanged weights the first minibatch sees only the fp32 rounding gap.
        assert r["logprob_diff_max"] < 1e-4 and r["logprob_diff_mean"] < 1e-5, r
        assert r["clip_frac"] == r["clip_frac_tokens"] and 0 <= r["clip_frac_seqs"] <= 1
        # The weights are the policy's moves over the step's minibatches (6% in the geometric mean seen): not 1, none
        # beyond a token ratio of e^3.
        assert 0 < abs(r["correction_weight_max"] - 1) < 0.5 and r["correction_rejected_seqs"] == 0.0, r
    replay = tmp_path / "grpo_rr"
    _train(replay, 2, "algo.name=grpo", "algo.routing_replay=old", "correction.level=token", "correction.mode=mask",
           *quick)
    for r in _records(replay):
        assert r["time/old_logprobs"] > 0 and "expert_volatility" not in r, sorted(r)  # replay pins the routing
        assert r["clip_frac"] == r["clip_frac_tokens"] and r["logprob_diff_max"] < 1e-4
        # The pass and the fp32 engine agree to rounding: every weight ~1, none outside [0.5, 2].
        assert abs(r["correction_weight_max"] - 1) < 1e-4 and r["correction_masked_tokens"] == 0.0, r


@SCHEDULE_ONLY
def test_one_step_off_through_the_loop(tmp_path):
    """rollout.mode=one_step_off in the real loop (local engine): step 1 trains on version 0's samples, every later
    step on samples one version old, sampled while the previous step updated; eval, checkpoints and resume work."""
    run = tmp_path / "run"
    _train(run, 3, "rollout.mode=one_step_off", "checkpoint.every=0")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [(r["staleness_mean"], r["staleness_max"]) for r in records] == [(0, 0), (1, 1), (1, 1)], records
    assert [(r["weight_version_min"], r["weight_version_max"]) for r in records] == [(0, 0), (0, 0), (1, 1)]
    # Step 1's samples are the trainer's weights' (recomputed pi_old agrees with the engine to rounding).
    assert records[0]["logprob_diff_max"] < 1e-4
    assert "eval_reward_mean" in records[1] and all(r["time/rollout_wait"] >= 0 for r in records)
    assert (run / "ck" / "latest").read_text() == "step_000003"
    # Resumed, the batch sampled ahead is gone: step 4 samples afresh under the resumed weights (version 3).
    _train(run, 4, "rollout.mode=one_step_off", "checkpoint.every=0", "--resume")
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 4 and last["staleness_max"] == 0 and last["weight_version_min"] == 3, last

    # The same on two data-parallel ranks (torchrun): rank 0's background thread talks to the engine only, the
    # batch's broadcast and the weight sync stay in order on both ranks; same versions, same first rollout. With the
    # distributed optimizer (the default, which the example turns off): no rank prints a third-party warning, as
    # torch's .grad UserWarning on megatron-core's shards and its reduce_scatter_tensor FutureWarning were
    # (environment.KNOWN_NOISE, reaching the ranks through PYTHONWARNINGS).
    two = tmp_path / "two"
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    command = _command(two, 3, "rollout.mode=one_step_off", "checkpoint.every=0", "parallel.distributed_optimizer=true")
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", *command[1:]], capture_output=True,
                         text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    noise = [line for line in out.stderr.splitlines() if "Warning" in line]
    assert not noise and ".grad attribute" not in out.stderr, noise
    pair = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert [(r["staleness_max"], r["weight_version_min"]) for r in pair] == [(0, 0), (1, 0), (1, 1)], pair
    assert pair[0]["reward_mean"] == records[0]["reward_mean"]  # version 0's samples: the same engine, weights, seed


@SCHEDULE_ONLY
def test_decoupled_clip_weights_the_stale_samples(tmp_path):
    """algo.decoupled_clip under one_step_off through the real loop: the samples one version old are clipped around
    the trainer's weights and weighted by the correction's geometric weight (pi_prox / pi_behaviour)^(1/|y|); its
    largest log is the rollout-vs-trainer gap the mismatch metrics measure independently (max |mean token diff| of
    a sequence), when that gap is the positive side's."""
    run = tmp_path / "run"
    _train(run, 3, "rollout.mode=one_step_off", "algo.decoupled_clip=true", "correction.high=100",
           "checkpoint.every=0", "train.eval_every=0", "logging.plot_every=0")
    records = _records(run)
    # Version 0's samples trained by version 0: none stale, every weight 1 up to fp32 rounding.
    assert abs(records[0]["correction_weight_max"] - 1) < 1e-5, records[0]
    for r in records[1:]:
        assert r["staleness_max"] == 1 and r["correction_truncated_tokens"] == 0.0, r
        assert r["logprob_diff_seq_log_ratio"] > 1e-4  # one update apart: far beyond fp32 rounding
        widest = math.log(r["correction_weight_max"])
        assert 0 < widest <= r["logprob_diff_seq_log_ratio"] * (1 + 1e-5) + 1e-7, r
    # With a cap below every weight > 1 those weights are cut there; here with the README's fast CPU settings
    # (packed rows, one trainer thread).
    capped = tmp_path / "capped"
    _train(capped, 2, "rollout.mode=one_step_off", "algo.decoupled_clip=true", "correction.high=1",
           "parallel.pack_sequences=true", "train.cpu_threads=1", "checkpoint.every=0", "train.eval_every=0",
           "logging.plot_every=0")
    last = _records(capped)[1]
    assert last["correction_weight_max"] == 1.0 and last["correction_truncated_tokens"] > 0, last
    # Partial rollouts: a sample spanning versions is stale; its behaviour log-probs are per token, from each chunk's
    # weights.
    partial = tmp_path / "partial"
    _train(partial, 3, "rollout.partial_chunk_tokens=2", "algo.decoupled_clip=true", "checkpoint.every=0",
           "train.eval_every=0", "logging.plot_every=0")
    spanning = [r for r in _records(partial) if r["staleness_max"] >= 1]
    assert spanning and all(0 < r["correction_weight_mean"] <= r["correction_weight_max"] <= 2.0
                            and math.isfinite(r["loss"]) for r in spanning), _records(partial)


@SCHEDULE_ONLY
def test_partial_rollouts_through_the_loop(tmp_path):
    """rollout.partial_chunk_tokens in the real loop (local engine): samples cut at a step's end continue under the
    next step's weights, so a trained sample spans two versions (pi_old: the engine's per-token log-probs); every
    logged number is finite; resumed from step 2 (groups in flight in the checkpoint) step 3 ends with bit-identical
    weights. With partial_mask=old_tokens the older tokens leave the loss and the step still runs."""
    run = tmp_path / "run"
    _train(run, 3, "rollout.partial_chunk_tokens=2", "logging.plot_every=0")
    records = _records(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (r["step"], bad)
    assert records[0]["partial/max_versions_spanned"] == 1 and records[0]["staleness_max"] == 0
    spanning = [r for r in records if r["partial/max_versions_spanned"] >= 2]
    assert spanning and all(r["staleness_max"] >= 1 and r["partial/old_tokens_frac"] > 0 for r in spanning), records
    assert records[0]["logprob_diff_max"] < 1e-4  # chunks continued from ids score as one sequence (one version)
    assert records[1]["partial/samples_carried"] > 0  # in flight at the step-2 checkpoint
    resumed = tmp_path / "resumed"
    shutil.copytree(run / "ck" / "step_000002", resumed / "ck" / "step_000002")
    (resumed / "ck" / "latest").write_text("step_000002")
    _train(resumed, 3, "rollout.partial_chunk_tokens=2", "logging.plot_every=0", "--resume")
    assert _records(resumed)[0]["partial/samples_spanning_versions"] == records[2]["partial/samples_spanning_versions"]
    (a, b), = run_on_ranks(final_weights, 1, None, str(run / "ck" / "step_000003"),
                           str(resumed / "ck" / "step_000003"))
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"
    masked = tmp_path / "masked"
    _train(masked, 2, "rollout.partial_chunk_tokens=2", "rollout.partial_mask=old_tokens", "checkpoint.every=0",
           "logging.plot_every=0", "train.eval_every=0")
    for r in _records(masked):
        # Only the current version's tokens are compared (and trained): each equals the trainer's recomputation, so
        # every token's recorded version is the one that sampled it (older tokens differ by ~0.5, see above).
        assert math.isfinite(r["loss"]) and r["logprob_diff_max"] < 1e-4, r
    assert _records(masked)[1]["partial/old_tokens_frac"] > 0
