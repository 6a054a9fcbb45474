"""Rank 0's long solo work (a rollout, an eval) outlasts the collective timeout without killing the job: the other
ranks wait for it in the gloo control group, and the same wait in a plain world-group collective does time out.

Real gloo ranks, the loop's own ``make_engine`` / ``collect`` / ``evaluate`` with the local engine on a tiny model;
rank 0's engine is slowed down past the world group's timeout (``distributed.timeout_s``, here 4 s).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.train.startup.config import ConfigError, load_config
from gspo_megatron.train.startup.validate import validate

ROOT = Path(__file__).resolve().parents[3]
WORLD_TIMEOUT_S = 4.0  # the world group's collective timeout in this test (also bounds start-up skew of the ranks)
SLOW_S = WORLD_TIMEOUT_S + 3.0  # how long rank 0's engine takes per generate call


class _Slow:
    """An engine that takes ``seconds`` longer per generate call (a long-CoT rollout)."""

    def __init__(self, engine, seconds: float):
        self.engine, self.seconds = engine, seconds

    def generate(self, *args, **kwargs):
        time.sleep(self.seconds)
        return self.engine.generate(*args, **kwargs)


def _slow_rollout_and_eval(model_dir: str) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from gspo_megatron.train.sampling import broadcast
    from gspo_megatron.train.sampling import engine as sampling_engine
    from gspo_megatron.train.sampling.rounds import Sampler
    from gspo_megatron.train.startup.bootstrap import reward_function
    from gspo_megatron.train.startup.data import task_prompts

    torch.set_num_threads(1)
    cfg = load_config(ROOT / "examples/tiny_moe_cpu.yaml", [
        "rollout.engine=local", "rollout.group_size=2", "rollout.max_new_tokens=3", f"model.hf_dir={model_dir}"])
    rank = dist.get_rank()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = task_prompts("reverse", tokenizer, 2, seed=0)
    engine = sampling_engine.make_engine(cfg, model_dir, tokenizer)
    if rank == 0:
        engine = _Slow(engine, SLOW_S)
    out = {}
    start = time.monotonic()
    sampler = Sampler(engine, cfg, tokenizer, reward_function(cfg))
    rollout = broadcast.collect(sampler, prompts, 1, pad_multiple=1)
    out["collect_s"] = time.monotonic() - start
    out["rewards"] = rollout.rewards.tolist()
    out["response_ids"] = [s.response_ids for s in rollout.samples]
    start = time.monotonic()
    out["eval"] = broadcast.evaluate(sampler, prompts, 1)
    out["eval_s"] = time.monotonic() - start

    # The same wait in the world group: rank 0 busy as long, rank 1 in a plain broadcast times out.
    if rank == 0:
        time.sleep(WORLD_TIMEOUT_S + 2.0)
    else:
        start = time.monotonic()
        try:
            dist.broadcast_object_list([None], src=0)
            out["world_error"] = None
        except RuntimeError as e:
            out["world_error"] = str(e)
        out["world_s"] = time.monotonic() - start
    return out


def test_rank0_rollout_longer_than_the_collective_timeout(tmp_path):
    from gspo_megatron.rewards.synthetic import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model", seed=0, vocab_size=128, hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, head_dim=16, num_experts=2, top_k=1, moe_intermediate_size=16)
    # Fresh ranks: a collective that timed out is under test, and it leaves its ranks' groups broken.
    rank0, rank1 = run_on_ranks(_slow_rollout_and_eval, 2, None, str(model_dir), timeout=180, fresh=True,
                                dist_timeouts={"timeout_s": WORLD_TIMEOUT_S, "control_timeout_s": 120.0})
    # Rank 1 waited past the world timeout for each of rank 0's generate calls, and got rank 0's results.
    assert rank1["collect_s"] > WORLD_TIMEOUT_S and rank1["eval_s"] > WORLD_TIMEOUT_S, rank1
    assert rank1["rewards"] == rank0["rewards"] and rank1["response_ids"] == rank0["response_ids"]
    assert len(rank1["rewards"]) == 4 and rank1["eval"] == rank0["eval"]
    # Teeth: a world-group collective waiting as long fails, after about the configured timeout.
    assert rank1["world_error"] is not None, "a world-group broadcast outlived distributed.timeout_s"
    assert WORLD_TIMEOUT_S - 0.5 < rank1["world_s"] < SLOW_S, rank1


@pytest.mark.parametrize("overrides, message", [
    (["distributed.timeout_s=0"], r"distributed.timeout_s=0 must be a positive number of seconds"),
    (["distributed.control_timeout_s=nan"], r"distributed.control_timeout_s=nan must be a positive"),
    (["distributed.timeout_s=300"], r"distributed.timeout_s=300 must exceed the weight sync's limit per call"),
    (["distributed.control_timeout_s=1800"],
     r"distributed.control_timeout_s=1800 must exceed the rollout's limit "
     r"\(rollout.server_args.rollout_timeout_s=3600\)"),
    (["distributed.control_timeout_s=1800", "rollout.server_args={rollout_timeout_s: 2400}"],
     r"rollout_timeout_s=2400\)"),
    (["distributed.timeout_s=ten"], r"distributed.timeout_s: expected float, got 'ten'"),
    (["rollout.server_args={rollout_timeout_s: soon}"], r"rollout.server_args.rollout_timeout_s='soon' must be a"),
])
def test_timeouts_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, ["data.task=count", *overrides]), 1)


def test_timeouts_that_fit_pass():
    cfg = load_config(None, ["data.task=count", "distributed.control_timeout_s=1800",
                             "rollout.server_args={rollout_timeout_s: 1200}"])
    validate(cfg, 1)
    assert (cfg.distributed.timeout_s, cfg.distributed.control_timeout_s) == (1800.0, 1800.0)
    validate(load_config(None, ["data.task=count", "rollout.engine=local", "distributed.control_timeout_s=60"]), 1)
