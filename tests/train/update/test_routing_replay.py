"""GRPO + Routing Replay through megatron-core's RouterReplay.

The old-policy pass records each token's experts (micro batches of 4); the update pass (micro batches of 2)
replays them. Replayed on the same weights, the routing and so the log-probs are reproduced exactly (a
misaligned token order would pick other experts and change them). After the router drifts, the update pass
without replay routes many tokens differently, with replay it keeps the old routing.
Runs at DP=2 (each rank a whole model) and TP=2 with sequence parallelism (routers see sequence shards).
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.train.update.loss import LossConfig
from gspo_megatron.train.update.schedules import logprob_pass, update_step
from tests import megatron_tiny as tiny
from tests.train.update.test_schedules import NUM_SEQUENCES, make_rollout, micro_batches

pytestmark = pytest.mark.megatron  # builds a Megatron model

GRPO = LossConfig.grpo()


def _changed_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of (token, layer) whose top-k expert *set* differs."""
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1).float().mean().item()


def _check(layouts):
    from gspo_megatron.parallel import groups

    out = {}
    for name, layout in layouts:
        groups.init_model_parallel(layout)
        torch.manual_seed(0)
        model = tiny.wrap_ddp(tiny.build_model(per_sequence_loss=True, routing_replay=True))
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.0), [model])
        rollout = make_rollout()
        old = logprob_pass(model, micro_batches(rollout, 0, NUM_SEQUENCES, 4), record_old_routing=True)
        rollout.update(old_logprobs=old["logprobs"], old_routing=old["old_routing"])
        same = update_step(model, optimizer, micro_batches(rollout, 0, NUM_SEQUENCES, 2), GRPO, replay_old_routing=True)

        # Router drift: the old policy's routing is no longer what the router would choose.
        with torch.no_grad():
            for layer in tiny.unwrap_layers(model):
                layer.mlp.router.weight.add_(torch.randn_like(layer.mlp.router.weight))
        drifted = logprob_pass(model, micro_batches(rollout, 0, NUM_SEQUENCES, 4), record_old_routing=True)
        replayed = update_step(model, optimizer, micro_batches(rollout, 0, NUM_SEQUENCES, 2), GRPO,
                               replay_old_routing=True)
        free = update_step(
            model, optimizer, micro_batches({k: v for k, v in rollout.items() if k != "old_routing"}, 0, NUM_SEQUENCES, 2),
            GRPO)
        # update_step gathers every DP rank's sequences (each rank here trains on all 8): keep this rank's.
        from megatron.core import parallel_state as ps

        mine = slice(ps.get_data_parallel_rank() * NUM_SEQUENCES, (ps.get_data_parallel_rank() + 1) * NUM_SEQUENCES)
        same, replayed, free = ({k: out_[k][mine] for k in ("valid", "seq_log_ratio")} for out_ in (same, replayed, free))
        valid = same["valid"]
        out[name] = {
            "same_ratio": same["seq_log_ratio"][valid].abs().max().item(),
            "routing_changed": _changed_fraction(drifted["old_routing"], old["old_routing"]),
            "replayed_vs_free": (replayed["seq_log_ratio"] - free["seq_log_ratio"])[valid].abs().max().item(),
            "free_vs_drifted_pass": (
                free["seq_log_ratio"] - (drifted["seq_logprob"] - old["seq_logprob"]) / drifted["num_tokens"].clamp_min(1)
            )[valid].abs().max().item(),
        }
    return out


def test_routing_replay_reproduces_and_pins_the_old_routing():
    layouts = [("dp2", Layout()), ("tp2_sp", Layout(tensor=2, sequence_parallel=True))]
    for rank, result in enumerate(run_on_ranks(_check, 2, None, layouts)):
        for name, r in result.items():
            where = f"{name} rank {rank}"
            assert r["same_ratio"] <= 2e-6, f"{where}: replay on the same weights changed log-probs by {r['same_ratio']:.2e}"
            assert r["routing_changed"] > 0.2, f"{where}: the drift changed only {r['routing_changed']:.0%} of routes"
            # Without replay the update pass sees exactly what a fresh pass sees; with replay it does not.
            assert r["free_vs_drifted_pass"] <= 2e-6, where
            assert r["replayed_vs_free"] > 1e-3, f"{where}: replay made no difference ({r['replayed_vs_free']:.2e})"
