"""A rollout server restarted without the current weights (they came by distributed sync) in the middle of a
step's rollout: ``broadcast.collect`` has every rank sync again and rank 0 generate the step again. On two
ranks with dynamic sampling (so rank 0 draws extra prompts before the failure): the rollout, the prompts and every
rank's data position equal an undisturbed run's, every rank resynced once, and the engine's fault metrics are in
the step's metrics; evaluate does the same."""

from __future__ import annotations

from gspo_megatron.parallel.launch import run_on_ranks

from .test_dynamic_sampling import GROUP, MIXED, PROMPTS, FakeEngine, FakeTokenizer, reward


class RestartedEngine(FakeEngine):
    """Raises StaleWeights once, at generate call ``fail_at`` (1-based), until a resync."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.fail_at, self.failed = fail_at, False

    def generate(self, prompt_ids, n, sampling):
        from gspo_megatron.rollout import StaleWeights

        if not self.failed and len(self.calls) + 1 == self.fail_at:
            self.failed = True
            raise StaleWeights("['http://127.0.0.1:1'] restarted and serve their launch weights")
        return super().generate(prompt_ids, n, sampling)

    def fault_metrics(self):
        return {"rollout/server_restarts": 1.0, "rollout/seconds_lost": 2.5}


def _run(fail_at: int | None) -> dict:
    import torch.distributed as dist

    from gspo_megatron.train.sampling import broadcast
    from gspo_megatron.train.sampling.rounds import Sampler
    from gspo_megatron.train.startup.config import load_config
    from gspo_megatron.train.startup.data import Prompt, PromptStream

    cfg = load_config(None, [f"rollout.group_size={GROUP}", f"rollout.prompts_per_step={PROMPTS}",
                             "rollout.filter_zero_variance_groups=true", "rollout.max_sampling_rounds=3"])
    stream = PromptStream([Prompt([i + 1, 7], f"p{i}", label) for i, label in enumerate(MIXED)], seed=0)
    engine = (RestartedEngine(fail_at) if fail_at else FakeEngine()) if dist.get_rank() == 0 else None
    resyncs = []
    sampler = Sampler(engine, cfg, FakeTokenizer(), reward)
    rollout = broadcast.collect(sampler, stream.next(PROMPTS), 1, pad_multiple=1, more_prompts=stream.next,
                                resync=lambda: resyncs.append(1))
    if engine is not None and fail_at:
        engine.failed, engine.fail_at = False, len(engine.calls) + 1  # the evaluation's generate fails too
    evaluated = broadcast.evaluate(sampler, stream.next(2), 1, resync=lambda: resyncs.append(2))
    return {"prompts": [s.prompt_ids[0] - 1 for s in rollout.samples[::GROUP]], "rewards": rollout.rewards.tolist(),
            "position": stream.state_dict(), "resyncs": resyncs, "metrics": rollout.metrics,
            "eval": evaluated["eval_reward_mean"]}


def cases() -> dict:
    return {"undisturbed": _run(None), "second_round": _run(2)}


def test_collect_resyncs_and_generates_again():
    for rank in run_on_ranks(cases, 2, None):
        undisturbed, restarted = rank["undisturbed"], rank["second_round"]
        assert restarted["prompts"] == undisturbed["prompts"] and restarted["rewards"] == undisturbed["rewards"]
        assert restarted["position"] == undisturbed["position"]  # rank 0's redrawn prompts reused, not drawn again
        assert restarted["eval"] == undisturbed["eval"]
        assert undisturbed["resyncs"] == [] and restarted["resyncs"] == [1, 2]
        assert restarted["metrics"]["rollout/server_restarts"] == 1.0
        assert restarted["metrics"]["rollout/seconds_lost"] == 2.5

