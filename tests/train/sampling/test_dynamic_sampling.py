"""DAPO's dynamic sampling (``rollout.filter_zero_variance_groups``) in ``broadcast.collect``.

A fake engine answers sample k of every group with the text "k"; a fake reward gives prompts labelled
"uniform" 1.0 whatever the response (a group without reward variance) and the others 1.0 for "0" only. On two
ranks (rank 0 samples, both build the batch): groups without variance are dropped and more prompts drawn until
the batch is full, every rank's prompt stream ends at the same position, the metrics count what happened; when
every prompt is uniform the rounds stop at ``rollout.max_sampling_rounds`` and dropped groups fill the batch;
without the option the batch is the first prompts' groups, as before.
"""

from __future__ import annotations

import torch

from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.train.sampling.rounds import uniform_groups

GROUP, PROMPTS = 2, 4
MIXED = ["uniform", "x", "uniform", "uniform", "x", "uniform", "x", "uniform", "uniform", "x", "x", "x",
         "x", "x", "x", "x"]


class FakeEngine:
    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, n, sampling):
        from gspo_megatron.rollout.types import Group, Sample

        self.calls.append((len(prompt_ids), sampling.seed))
        return [Group(i, ids, [Sample(ids, [k + 1], [-0.5], "stop", "0", prompt_index=i, sample_index=k, text=str(k))
                               for k in range(n)]) for i, ids in enumerate(prompt_ids)]


class FakeTokenizer:
    eos_token_id = 0


def reward(prompt, response, label):
    return 1.0 if label == "uniform" else float(response == "0")


def _collect(labels, overrides) -> dict:
    import torch.distributed as dist

    from gspo_megatron.train.sampling import broadcast
    from gspo_megatron.train.sampling.rounds import Sampler
    from gspo_megatron.train.startup.config import load_config
    from gspo_megatron.train.startup.data import Prompt, PromptStream

    cfg = load_config(None, [f"rollout.group_size={GROUP}", f"rollout.prompts_per_step={PROMPTS}"] + overrides)
    stream = PromptStream([Prompt([i + 1, 7], f"p{i}", label) for i, label in enumerate(labels)], seed=0)
    engine = FakeEngine() if dist.get_rank() == 0 else None
    rollout = broadcast.collect(Sampler(engine, cfg, FakeTokenizer(), reward), stream.next(PROMPTS), 1, pad_multiple=1,
                                more_prompts=stream.next)
    return {"prompts": [s.prompt_ids[0] - 1 for s in rollout.samples[::GROUP]], "rewards": rollout.rewards,
            "metrics": {k: v for k, v in rollout.metrics.items() if k != "example"}, "rows": rollout.batch["input_ids"].shape[0],
            "position": stream.state_dict(), "drawn": stream._order[:stream.index],
            "calls": engine.calls if engine else None}


def cases() -> dict:
    on = ["rollout.filter_zero_variance_groups=true", "rollout.max_sampling_rounds=3"]
    return {"filtered": _collect(MIXED, on), "all_uniform": _collect(["uniform"] * 40, on),
            "off": _collect(MIXED, [])}


def test_uniform_groups():
    values = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.2, 0.0, 0.0])
    valid = torch.tensor([True, True, True, True, True, False, False, True])
    assert uniform_groups(values, valid, 2).tolist() == [True, False, True, True]


def test_dynamic_sampling_fills_the_batch_with_signal():
    results = run_on_ranks(cases, 2, None)
    rank0, rank1 = results
    for name in ("filtered", "all_uniform", "off"):
        assert rank0[name]["position"] == rank1[name]["position"], name  # the same data position everywhere
        assert rank0[name]["prompts"] == rank1[name]["prompts"] and rank0[name]["rows"] == PROMPTS * GROUP
    filtered = rank0["filtered"]
    groups = filtered["rewards"].view(-1, GROUP)
    assert (groups.std(dim=1) > 0).all(), filtered  # every kept group carries signal
    m = filtered["metrics"]
    drawn = [MIXED[i] for i in filtered["drawn"]]
    assert m["sampling/prompts"] == len(drawn) == sum(n for n, _ in filtered["calls"]) > PROMPTS, (m, filtered)
    assert m["sampling/groups_dropped"] == drawn.count("uniform"), (m, drawn)
    assert all(MIXED[i] == "x" for i in filtered["prompts"]), filtered  # the kept groups: the first with signal
    assert filtered["prompts"] == [i for i in filtered["drawn"] if MIXED[i] == "x"][:PROMPTS], filtered
    assert m["sampling/rounds"] == len(filtered["calls"]) >= 2 and m["sampling/uniform_groups_kept"] == 0, m
    assert len({seed for _, seed in filtered["calls"]}) == len(filtered["calls"])  # each round samples afresh
    assert abs(m["groups_zero_advantage"] - m["sampling/groups_dropped"] / m["sampling/prompts"]) < 1e-6, m
    uniform = rank0["all_uniform"]
    assert uniform["metrics"]["sampling/rounds"] == 3 == len(uniform["calls"]), uniform["metrics"]
    assert uniform["metrics"]["sampling/uniform_groups_kept"] == PROMPTS, uniform["metrics"]
    off = rank0["off"]
    assert off["prompts"] == off["drawn"] and len(off["calls"]) == 1, off
    assert not any(k.startswith("sampling/") for k in off["metrics"]), off["metrics"]
