"""``train/sampling/partial_rollouts.py``: samples still running when a step's batch is full are cut, carried, and continued
next step from their token ids under the new weights.

A fake engine knows every sample's whole response in advance (prompt i's sample k: ``_length(i, k)`` tokens,
token j = 100 (k + 1) + j, the last one the stop token 0) and gives token j the log-prob -(j + 1) / 100 minus
the version it serves, so a sample's tokens, log-probs and versions show exactly which call and which weights
produced each. Checked: every continuation is sent the prompt plus the response so far, token for token; log-probs
and versions are concatenated per token; a batch holds only complete groups, exactly prompts_per_step of them;
samples spanning versions are what ``Rollout.versions`` marks stale; with chunks as long as max_new_tokens every
step is sync mode's; on two ranks (RolloutSource, a stand-in weight sync) every rank gets the same batches and
data positions; the groups in flight survive a checkpoint and a step generated again after a resync (a
restarted server) starts from them as the step began. The loop runs it in tests/train/test_loop.py.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.parallel.launch import run_on_ranks

GROUP, PROMPTS, MAX_NEW = 2, 2, 8


def _length(i: int, k: int) -> int:
    """Prompt i's sample k: response tokens until its stop token (over MAX_NEW: cut at MAX_NEW, "length")."""
    return 1 + (3 * i + 5 * k) % 10


def _response(i: int, k: int) -> list[int]:
    n = _length(i, k)
    return [100 * (k + 1) + j for j in range(min(n, MAX_NEW))][:n - 1] + ([0] if n <= MAX_NEW else [])


class FakeEngine:
    def __init__(self):
        self.version, self.calls, self.errors = "0", [], []

    def weight_version(self):
        return self.version

    def generate(self, prompt_ids, n, sampling):
        from gspo_megatron.rollout.types import Group, Sample

        self.calls.append(([list(p) for p in prompt_ids], n, sampling.max_new_tokens, self.version))
        groups = []
        for g, ctx in enumerate(prompt_ids):
            i, so_far = ctx[0] - 1, list(ctx[2:])
            samples = []
            for s in range(n):
                k = so_far[0] // 100 - 1 if so_far else s
                whole = _response(i, k)
                if so_far != whole[:len(so_far)]:
                    self.errors.append((ctx, "is not prompt + the response so far"))
                new = whole[len(so_far):len(so_far) + sampling.max_new_tokens]
                done = len(so_far) + len(new) == len(whole) and _length(i, k) <= MAX_NEW
                served = float(self.version.split("-")[0])  # "3-resync1": version 3 sent again
                logprobs = [-(len(so_far) + j + 1) / 100 - served for j in range(len(new))]
                samples.append(Sample(list(ctx), new, logprobs, "stop" if done else "length", self.version, g, s))
            groups.append(Group(g, list(ctx), samples))
        return groups


class RestartedEngine(FakeEngine):
    """Raises StaleWeights once, at generate call ``fail_at`` (1-based): a server restarted mid-step."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.fail_at = fail_at

    def generate(self, prompt_ids, n, sampling):
        from gspo_megatron.rollout import StaleWeights

        if len(self.calls) + 1 == self.fail_at:
            self.fail_at = None
            raise StaleWeights("['http://127.0.0.1:1'] restarted and serve their launch weights")
        return super().generate(prompt_ids, n, sampling)


class FakeTokenizer:
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _reward(prompt, response, label):
    return float(len(response) % 3)


def _cfg(chunk: int, *extra):
    from gspo_megatron.train.startup.config import load_config

    return load_config(None, [f"rollout.group_size={GROUP}", f"rollout.prompts_per_step={PROMPTS}",
                              f"rollout.max_new_tokens={MAX_NEW}", f"rollout.partial_chunk_tokens={chunk}",
                              "data.reward_workers=0", *extra])


def _stream():
    from gspo_megatron.train.startup.data import Prompt, PromptStream

    return PromptStream([Prompt([i + 1, 7], f"p{i}", "x") for i in range(40)], seed=0)


def test_continuations_are_token_exact_and_batches_hold_complete_groups():
    from gspo_megatron.rollout.types import SamplingParams
    from gspo_megatron.train.sampling.partial_rollouts import PartialRollouts

    engine, stream, partial = FakeEngine(), _stream(), PartialRollouts(_cfg(3))
    sampling = SamplingParams(max_new_tokens=MAX_NEW, seed=5)
    spanning = 0
    for version in range(6):
        engine.version = str(version)
        samples, prompts, _, drawn, metrics = partial.step(engine, stream.next, sampling, version)
        assert len(prompts) == PROMPTS and len(samples) == PROMPTS * GROUP  # complete groups, exactly P
        for s in samples:
            i, k = prompts[s.prompt_index].ids[0] - 1, s.sample_index
            assert s.prompt_ids == prompts[s.prompt_index].ids and s.response_ids == _response(i, k)
            assert s.finish_reason == ("stop" if _length(i, k) <= MAX_NEW else "length")
            # Each token's log-prob is the one the engine gave it, under the version that sampled it.
            expected = [-(j + 1) / 100 - v for j, v in enumerate(s.token_versions)]
            assert s.logprobs == pytest.approx(expected, abs=1e-12), s
            assert s.token_versions == sorted(s.token_versions) and s.token_versions[-1] <= version
            spanning += len(set(s.token_versions)) > 1
        assert metrics["partial/max_versions_spanned"] == max(len(set(s.token_versions)) for s in samples)
        carried = [s for g in partial.live for s, r in zip(g.samples, g.running) if r]
        assert metrics["partial/samples_carried"] == len(carried)
        assert metrics["partial/tokens_carried"] == sum(len(s.response_ids) for s in carried)
    assert spanning > 0 and not engine.errors, engine.errors
    for contexts, n, budget, _ in engine.calls:
        assert budget <= 3 and (n == GROUP or n == 1)  # chunks of at most 3 tokens; continuations one by one
        assert all(len(c) - 2 + budget <= MAX_NEW for c in contexts)  # never past max_new_tokens in all


def test_groups_in_flight_survive_a_checkpoint():
    """``state_dict`` (plain lists: JSON round trip) restored into a fresh buffer continues exactly as the original."""
    import json

    from gspo_megatron.rollout.types import SamplingParams
    from gspo_megatron.train.sampling.partial_rollouts import PartialRollouts

    sampling = SamplingParams(max_new_tokens=MAX_NEW, seed=5)

    def run(steps, partial, stream, start=0):
        engine, out = FakeEngine(), []
        for version in range(start, steps):
            engine.version = str(version)
            samples, prompts, *_ = partial.step(engine, stream.next, sampling, version)
            out.append([(p.ids, s.response_ids, s.logprobs, s.token_versions) for p in prompts for s in samples])
        return out

    whole = run(5, PartialRollouts(_cfg(3)), _stream())
    first, stream = PartialRollouts(_cfg(3)), _stream()
    head = run(2, first, stream)
    assert first.live, "nothing in flight at the checkpoint: the test would prove nothing"
    resumed, restored = PartialRollouts(_cfg(3)), _stream()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    restored.load_state_dict(stream.state_dict())
    assert head + run(5, resumed, restored, start=2) == whole


def _source_run(chunk: int, fail_at: int | None = None) -> dict:
    """RolloutSource in sync mode with partial rollouts on this rank (rank 0 owns the fake engine; ``fail_at``: its
    generate call that finds the server restarted, then every rank resyncs and rank 0 generates the step again)."""
    import torch.distributed as dist

    from gspo_megatron.parallel import control
    from gspo_megatron.train.weight_sync import sync as weight_sync
    from gspo_megatron.train.sampling.source import RolloutSource

    cfg = _cfg(chunk) if chunk else _cfg(1, "rollout.partial_chunk_tokens=null")
    stream = _stream()
    engine = (RestartedEngine(fail_at) if fail_at else FakeEngine()) if dist.get_rank() == 0 else None

    def sync_weights(policy, engine, version):  # stand-in: a collective, rank 0 loading the engine
        if engine is not None:
            engine.version = str(version)
        control.barrier()
        return {}

    weight_sync.sync_weights = sync_weights  # this rank process only
    source = RolloutSource(engine, stream, cfg, FakeTokenizer(), _reward, pad_multiple=1,
                                          policy=object())  # a policy: the source can resync (stand-in above)
    steps = []
    for step in range(1, 6):
        rollout = source.next(step, step - 1)
        steps.append({"input_ids": rollout.batch["input_ids"], "versions": rollout.versions,
                      "logprobs": rollout.batch["rollout_logprobs"],
                      "token_versions": rollout.batch.get("token_versions"), "mask": rollout.batch["loss_mask"],
                      "rewards": rollout.rewards, "position": source.position(), "metrics": rollout.metrics})
        source.sync_weights(None, step)
    source.close()
    return {"steps": steps, "calls": engine.calls if engine else None, "errors": engine.errors if engine else []}


def _source_runs() -> dict:
    return {"partial": _source_run(3), "whole_chunks": _source_run(MAX_NEW), "sync": _source_run(0),
            "restarted": _source_run(3, fail_at=6)}


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(_source_runs, 2, None)


def test_every_rank_gets_the_same_batches_and_data_positions(two_ranks):
    rank0, rank1 = two_ranks
    for mode in ("partial", "whole_chunks", "sync"):
        for k, (a, b) in enumerate(zip(rank0[mode]["steps"], rank1[mode]["steps"])):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["versions"], b["versions"]), (mode, k)
            assert a["position"] == b["position"], (mode, k)  # rank 1 drew as many prompts as rank 0 did
    assert not rank0["partial"]["errors"]
    steps = rank0["partial"]["steps"]
    # Groups begun in earlier steps: their rows carry older versions, which the loop marks stale (pi_old: engine's).
    assert any((s["versions"] < k).any() for k, s in enumerate(steps)), [s["versions"] for s in steps]
    for k, s in enumerate(steps):
        tv, mask = s["token_versions"], s["mask"]
        assert ((tv >= 0) == mask).all()  # a version on every response token, -1 elsewhere
        oldest = torch.where(mask, tv, torch.full_like(tv, 10**6)).amin(dim=1)
        assert torch.equal(oldest, s["versions"]) and s["metrics"]["staleness_max"] == k - int(oldest.min())


def test_chunks_of_max_new_tokens_are_sync_mode(two_ranks):
    whole, sync = two_ranks[0]["whole_chunks"], two_ranks[0]["sync"]
    for a, b in zip(whole["steps"], sync["steps"]):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["rewards"], b["rewards"])
        assert a["position"] == b["position"] and a["metrics"]["partial/samples_carried"] == 0
    assert [c[1:] for c in whole["calls"]] == [c[1:] for c in sync["calls"]]  # one call per step, n=G, whole


def test_a_step_generated_again_after_a_resync_starts_from_the_groups_in_flight(two_ranks):
    """A server restart mid-step (call 6: chunks of the step already appended): the step is generated again from the
    groups in flight as it began and the prompts rank 0 drew, so every batch and data position is the undisturbed
    run's."""
    for rank in two_ranks:
        for k, (a, b) in enumerate(zip(rank["restarted"]["steps"], rank["partial"]["steps"])):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["logprobs"], b["logprobs"]), k
            assert torch.equal(a["versions"], b["versions"]) and a["position"] == b["position"], k
    calls, undisturbed = two_ranks[0]["restarted"]["calls"], two_ranks[0]["partial"]["calls"]
    assert any("resync" in c[3] for c in calls)  # the failure happened, every rank synced again
    assert len(calls) > len(undisturbed)  # the failed attempt's chunks were generated again
