"""``train/sampling/source.py``: rollouts sampled when asked (sync), one step ahead, or up to max_staleness ahead.

On two ranks (rank 0 owns a fake engine that takes 0.2 s per batch and records what happens in order; the weight
sync is a stand-in collective): every mode gives every rank the same prompts, batches and data position as sync
mode, step by step; one_step_off samples batch k+1 before step k's weight sync starts (the overlap) and finishes
it before the sync (no race), so every sample is exactly one version old after the first step; async pauses the
servers around each sync instead of waiting and keeps staleness within max_staleness; the checkpointed position
is the one before the batches not trained on yet. The old-policy pass of a real policy (world 1) gives rows marked
stale the engine's log-probs and the others the trainer's.
"""

from __future__ import annotations

import time

import pytest
import torch

from gspo_megatron.parallel.launch import run_on_ranks

pytestmark = pytest.mark.megatron  # builds a Megatron model

GROUP, PROMPTS, STEPS = 2, 2, 5


class FakeEngine:
    """Answers every prompt's sample k with [k + 1]; its version is what the last weight sync set."""

    def __init__(self, log):
        self.log, self.version, self.paused = log, "0", False

    def weight_version(self):
        return self.version

    def generate(self, prompt_ids, n, sampling):
        from gspo_megatron.rollout.types import Group, Sample

        self.log.append(("generate", sampling.seed, self.version))
        time.sleep(0.2)
        self.log.append(("generated", sampling.seed, self.version))
        return [Group(i, ids, [Sample(ids, [k + 1], [-0.5], "stop", self.version, prompt_index=i, sample_index=k,
                                      text=str(k)) for k in range(n)]) for i, ids in enumerate(prompt_ids)]

    def pause_generation(self):
        self.paused = True
        self.log.append(("pause",))

    def continue_generation(self):
        self.paused = False
        self.log.append(("continue",))


class FakeTokenizer:
    eos_token_id = 0


def reward(prompt, response, label):
    return float(response == "0")


def _run(mode: str, max_staleness: int = 1) -> dict:
    import torch.distributed as dist

    from gspo_megatron.parallel import control
    from gspo_megatron.train.sampling import rounds
    from gspo_megatron.train.weight_sync import sync as weight_sync
    from gspo_megatron.train.sampling.source import RolloutSource
    from gspo_megatron.train.startup.config import load_config
    from gspo_megatron.train.startup.data import Prompt, PromptStream

    cfg = load_config(None, [f"rollout.group_size={GROUP}", f"rollout.prompts_per_step={PROMPTS}",
                             f"rollout.mode={mode}", f"rollout.max_staleness={max_staleness}",
                             "data.reward_workers=0"])
    stream = PromptStream([Prompt([i + 1, 7], f"p{i}", "x") for i in range(9)], seed=0)
    log: list = []
    engine = FakeEngine(log) if dist.get_rank() == 0 else None

    def sync_weights(policy, engine, version):  # stand-in: a collective, rank 0 loading the engine
        log.append(("sync", version))
        if engine is not None:
            assert not engine.paused or mode == "async"
            engine.version = str(version)
        control.barrier()
        return {}

    weight_sync.sync_weights = sync_weights  # this rank process only
    source = RolloutSource(engine, stream, cfg, FakeTokenizer(), reward, pad_multiple=1)
    steps = []
    try:
        for step in range(1, STEPS + 1):
            version = step - 1
            rollout = source.next(step, version)
            steps.append({"prompts": [s.prompt_ids[0] - 1 for s in rollout.samples[::GROUP]],
                          "versions": rollout.versions.tolist(),
                          "engine_versions": [s.weight_version for s in rollout.samples],
                          "input_ids": rollout.batch["input_ids"],
                          "staleness": (rollout.metrics["staleness_mean"], rollout.metrics["staleness_max"]),
                          "across_syncs": rollout.metrics.get("samples_across_syncs"),
                          "position": source.position()})
            time.sleep(0.5)  # the update (longer than a batch), during which the batches ahead are sampled
            log.append(("trained", step))
            source.sync_weights(None, version + 1)
    finally:
        source.close()
    return {"steps": steps, "log": log if engine is not None else None, "final": stream.state_dict()}


def modes() -> dict:
    return {"sync": _run("sync"), "one_step_off": _run("one_step_off"), "async": _run("async", 2)}


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(modes, 2, None)


def test_every_mode_gives_every_rank_the_sync_batches(results):
    rank0, rank1 = results
    sync = rank0["sync"]["steps"]
    for mode in ("sync", "one_step_off", "async"):
        for k, (a, b) in enumerate(zip(rank0[mode]["steps"], rank1[mode]["steps"])):
            assert a["prompts"] == b["prompts"] == sync[k]["prompts"], (mode, k)  # same data, same order
            assert torch.equal(a["input_ids"], b["input_ids"]), (mode, k)
            assert a["versions"] == b["versions"] and a["position"] == b["position"], (mode, k)
    # Positions to checkpoint: before the prompts of the batches not trained on yet, i.e. sync mode's.
    assert [s["position"] for s in rank0["one_step_off"]["steps"]] == [s["position"] for s in sync]
    assert [s["position"] for s in rank0["async"]["steps"]] == [s["position"] for s in sync]


def test_sync_is_never_stale(results):
    steps = results[0]["sync"]["steps"]
    assert all(s["staleness"] == (0.0, 0.0) and set(s["versions"]) == {k} for k, s in enumerate(steps))


def test_one_step_off_samples_during_the_update_and_is_one_version_old(results):
    run = results[0]["one_step_off"]
    steps, log = run["steps"], run["log"]
    # Step 1: version 0 samples trained by version 0; then each batch k is version k-2's, trained by k-1's.
    assert steps[0]["versions"] == [0] * PROMPTS * GROUP and steps[0]["staleness"] == (0.0, 0.0)
    for k, s in enumerate(steps[1:], start=2):
        assert s["versions"] == [k - 2] * PROMPTS * GROUP and s["staleness"] == (1.0, 1.0), (k, s)
        assert set(s["engine_versions"]) == {str(k - 2)}  # what the engine reported: the same version
    assert all(s["across_syncs"] == 0 for s in steps)
    # Batch k+1's generation starts before step k's weight sync (overlapping the update) and ends before it.
    for k in range(1, STEPS):
        started = next(i for i, e in enumerate(log) if e[0] == "generate" and e[1] == _seed(k + 1))
        ended = next(i for i, e in enumerate(log) if e[0] == "generated" and e[1] == _seed(k + 1))
        sync = log.index(("sync", k))
        assert started < log.index(("trained", k)) < sync and ended < sync, (k, log)
    assert ("pause",) not in log


def test_async_pauses_the_servers_and_bounds_staleness(results):
    run = results[0]["async"]
    steps, log = run["steps"], run["log"]
    for k, s in enumerate(steps, start=1):
        assert 0 <= s["staleness"][1] <= 2 and s["staleness"][0] == k - 1 - s["versions"][0], (k, s)
    assert max(s["staleness"][1] for s in steps) == 2, steps  # batches really were sampled two steps ahead
    syncs = [e for e in log if e[0] in ("pause", "sync", "continue")]
    assert syncs == [e for v in range(1, STEPS + 1) for e in (("pause",), ("sync", v), ("continue",))], syncs


def _seed(step: int) -> int:
    return 1234 * 100_003 + step  # rounds.sampling_params's seed of round 0 (train.seed 1234)


def _old_logprobs(hf_dir: str) -> dict:
    """``train.update.passes.old_logprobs`` on a synthetic batch, without and with half its rows marked stale."""
    from gspo_megatron.parallel import groups
    from gspo_megatron.train.update import passes
    from gspo_megatron.train.update.rows import row_plan
    from gspo_megatron.train.startup.bootstrap import loss_config
    from gspo_megatron.train.startup.config import load_config
    from gspo_megatron.plan.probe import synthetic_rollout
    from gspo_megatron.train.startup.policy import build_policy, layout_of

    cfg = load_config(None, ["data.task=reverse", "model.dtype=float32", "rollout.prompts_per_step=2",
                             "rollout.group_size=4", "parallel.micro_batch_size=4", f"model.hf_dir={hf_dir}"])
    groups.init_model_parallel(layout_of(cfg))
    policy = build_policy(cfg, hf_dir)
    batch = synthetic_rollout(cfg, 128, 32, seed=1)
    rows = row_plan(batch["input_ids"].shape[0], cfg)
    out = {"rollout": batch["rollout_logprobs"], "mask": batch["loss_mask"]}
    stale = torch.tensor([True, False] * 4)
    for name, extra in (("fresh", {}), ("stale", {"stale": stale})):
        b = dict(batch, **extra)
        passes.old_logprobs(policy, b, rows, cfg, loss_config(cfg), {})
        out[name] = b["old_logprobs"]
    out["stale_rows"] = stale
    return out


def test_stale_samples_take_the_engines_logprobs(moe_then_dense_dir):
    (out,) = run_on_ranks(_old_logprobs, 1, None, moe_then_dense_dir)
    stale, mask = out["stale_rows"], out["mask"]
    # pi_old of a sample from older weights: the engine's log-probs, exactly; of a current one: the trainer's pass.
    assert torch.equal(out["stale"][stale], out["rollout"][stale])
    assert torch.equal(out["stale"][~stale], out["fresh"][~stale])
    assert (out["fresh"][stale] - out["rollout"][stale])[mask[stale]].abs().max() > 0.1  # the two differ here
