"""The GSPO update step inside Megatron's schedules equals world=1 under every parallel layout.

Same weights (world=1 torch_dist checkpoint, loaded by resharding), same rollout minibatch of 8 sequences
(split over data-parallel ranks and micro batches of 2), Adam with gradient clipping. Compared with the
world=1 reference: the loss (1e-5 relative), the sequence log-ratios (2e-6 absolute), every gradient shard (1e-5 relative,
max |a - e| / max |e|), every updated weight shard (2e-6 absolute; weights are ~0.02, the step ~1e-3), the
gradient norm (1e-5 relative) and a step clipped to half of it (1e-5 of the largest weight change). Models are
built as the trainer builds models it loads weights into (no initialisation: ``provider.skip_weight_init``).
Also: 1, 2 or 4 micro batches (or uneven ones: 3, 1, 4 sequences) give the same gradient, the log-prob pass equals the loss's log-probs, and the
fused loss (the default) equals the log-prob op followed by the loss (``fused_loss=False``).

The other algorithms in the same launches (``ALGORITHMS``, on one more model per layout at lr 0, so every one sees
the loaded weights): GRPO token-mean and seq-mean-token-mean, GSPO-token with per-token advantages, GRPO + Routing
Replay of experts recorded under perturbed routers, and GSPO recording its routing against that record (expert
volatility). Each equals world=1 in loss, gradients (gradient norm under the distributed optimizer) and the
per-sequence statistics behind the logged metrics, which every rank holds for the whole minibatch (gathered over
data-parallel ranks). Context parallelism runs GSPO only (and expert volatility, a GSPO step).

Rollout corrections (``algo.correction``) against engine log-probs ~0.05 per token from pi_old, in the same
launches: GSPO with a geometric truncated weight and rejection by max |log w|, GSPO-token with token masks,
GRPO with a truncated token weight and the veto, and GSPO in bypass mode (the current policy against the engine's
log-probs, sequence-level masks, k3 rejection); the two GSPO ones under context parallelism too. At world 1 each
equals the pure function (``algo.rollout_correction`` + the loss) on the log-prob pass's log-probs, and the
unfused loss equals the fused.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from gspo_megatron.algo import (Correction, SEQUENCE_STATS, correction_metrics, group_advantages, grpo_loss,
                                gspo_loss, gspo_token_loss, rollout_correction, update_metrics)
from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.train.update.loss import LossConfig
from gspo_megatron.train.update.schedules import logprob_pass, update_step
from gspo_megatron.train.update.routing import routing_changes
from tests import megatron_tiny as tiny

NUM_SEQUENCES, GROUP, MICRO = 8, 4, 2
RTOL = 1e-5
# Adam's first step is lr * g / (|g| + eps): for a gradient far below eps (1e-6) it is lr / eps * g = 1e3 * g, so a
# gradient's fp32 rounding (~1e-9 absolute, from each layout's reduction order) moves its weight by ~1e-6: 2.15e-6
# seen for CP 2 on an AVX-512 Xeon, 2e-6 passed on an AMD EPYC. A wrong step moves weights by ~lr = 1e-3.
WEIGHT_ATOL = 5e-6
# A sequence log-ratio is a difference of fp32 log-probs of magnitude ~5: its noise floor is ~5e-7 absolute.
RATIO_ATOL = 2e-6
# Per-token log-probs / entropies (~5) and per-sequence sums of up to 16 of them, fp32.
PASS_ATOL = 2e-5
# A clipped step's weight changes, relative to the largest change (~1e-2 at lr 1 with Adam's eps 1, clipped to half
# the norm): fp32 rounding of the weights is ~1e-9; a wrong global norm changes every step by its ratio (~10%+).
CLIPPED_RTOL = 1e-5
ALGO = LossConfig(eps_low=3e-4, eps_high=4e-4)
ENTROPY_COEF = 0.5
# Token-level clips at 1e-3: the old log-probs' 1e-3 noise clips some tokens (0.2 would clip none).
TOKEN_CLIP = dict(eps_low=1e-3, eps_high=1e-3)
ALGORITHMS = {
    "grpo": LossConfig(name="grpo", **TOKEN_CLIP),
    "grpo_seq_mean": LossConfig(name="grpo", grpo_aggregation="seq-mean-token-mean", **TOKEN_CLIP),
    "gspo_token": LossConfig(name="gspo_token"),  # with per-token advantages
    "grpo_routing_replay": LossConfig(name="grpo", **TOKEN_CLIP),  # replays experts recorded under drifted routers
    "gspo_volatility": ALGO,  # records its routing, compared with that record
    "gspo_rollout_routing": ALGO,  # replays the engine's experts (R3): rollout_routes, whole sequences, every layer
    # Rollout corrections against the rollout's engine log-probs (rollout_logprobs), each clipping, weighting and
    # rejecting some sequences or tokens but not all.
    "gspo_corrected": LossConfig(correction=Correction(level="geometric", high=1.01, rejection="max",
                                                       rejection_high=0.12)),
    "gspo_token_corrected": LossConfig(name="gspo_token", correction=Correction(level="token", mode="mask", low=0.95,
                                                                                high=1.05)),
    "grpo_corrected": LossConfig(name="grpo", correction=Correction(level="token", high=1.03, veto=0.9),
                                 **TOKEN_CLIP),
    "gspo_bypass_corrected": LossConfig(reuse_rollout_logprobs=True, correction=Correction(
        level="sequence", mode="mask", low=0.8, high=1.2, rejection="mean", rejection_estimator="k3",
        rejection_high=2e-3)),
}
CORRECTED = ("gspo_corrected", "gspo_token_corrected", "grpo_corrected", "gspo_bypass_corrected")
CP_ALGORITHMS = ("gspo_volatility", "gspo_rollout_routing", "gspo_corrected", "gspo_bypass_corrected")
# The engine's log-probs: pi_old's plus this much noise per token (bf16 rollouts of a small model: ~1e-2).
ENGINE_GAP = 0.05
# Bypass mode's sequence-level weight exp(sum_t log pi_theta - log pi_engine) takes the layout's fp32 noise of the
# current log-probs (up to ~1e-6 a token) once per token of the sequence: ~1e-5 relative in the weight, and so in the
# loss and gradients, and in its logged weight sums (tokens x weight); a wrong weight or a flipped mask / rejection
# changes them by > 1e-2. (relative tolerance, per-sequence stats' absolute tolerance)
ALGORITHM_TOLERANCE = {"gspo_bypass_corrected": (1e-4, 1e-4)}
# Per-sequence stats: token counts and clip counts are exact; sums of up to 16 fp32 log-ratios / k3 terms.
STATS_ATOL = 2e-5


def make_rollout() -> dict:
    """8 sequences of 16 tokens: prompts of 3-8 tokens, then the response (one sequence is all prompt)."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, tiny.VOCAB, (NUM_SEQUENCES, tiny.SEQ + 1), generator=g)
    prompt = torch.randint(3, 9, (NUM_SEQUENCES,), generator=g)
    prompt[5] = tiny.SEQ + 1  # empty response: excluded from the loss
    positions = torch.arange(tiny.SEQ).unsqueeze(0)
    rewards = torch.rand(NUM_SEQUENCES, generator=g)
    return {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": positions + 1 >= prompt.unsqueeze(1),  # label t is token t+1
        "advantages": group_advantages(rewards, GROUP),
    }


def micro_batches(rollout: dict, first: int, count: int, size: int) -> list[dict]:
    return [{k: v[i : i + size] for k, v in rollout.items()} for i in range(first, first + count, size)]


def _routers(ddp):
    """(global layer number, router) of this pipeline stage's MoE layers."""
    return [(layer.layer_number, layer.mlp.router) for layer in tiny.unwrap_layers(ddp)]


def drifted_routing(ddp, rollout: dict, first: int, count: int) -> torch.Tensor:
    """The experts this rank's routers choose for rows [first, first + count) after a seeded drift of every router
    (seeded by its global layer number: the same drift under every layout), recorded by the log-prob pass; the
    routers are restored afterwards. [count, L_local, s_local, k]: an old policy whose routing differs."""
    saved = []
    with torch.no_grad():
        for layer_number, router in _routers(ddp):
            saved.append(router.weight.detach().clone())
            noise = torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(layer_number))
            router.weight.add_(0.5 * noise)
    routing = logprob_pass(ddp, micro_batches(rollout, first, count, MICRO), record_old_routing=True)["old_routing"]
    with torch.no_grad():
        for (_, router), weight in zip(_routers(ddp), saved):
            router.weight.copy_(weight)
    return routing


def rollout_routes() -> torch.Tensor:
    """An engine's routes for every row of ``make_rollout`` (rollout routing replay): [N, S, layers, top-k] int16,
    2 distinct random experts of 4 per token and layer, the same under every layout."""
    g = torch.Generator().manual_seed(12)
    return torch.rand(NUM_SEQUENCES, tiny.SEQ, 2, 4, generator=g).argsort(dim=-1)[..., :2].to(torch.int16)


def algorithm_batch(name: str, rollout: dict, token_advantages: torch.Tensor) -> dict:
    """The rollout as ``name`` trains on it: GSPO-token with per-token advantages; in bypass mode pi_old is the
    engine's (rollout.reuse_rollout_logprobs)."""
    cfg = ALGORITHMS[name]
    batch = dict(rollout, advantages=token_advantages) if cfg.name == "gspo_token" else dict(rollout)
    if cfg.reuse_rollout_logprobs:
        batch["old_logprobs"] = rollout["rollout_logprobs"]
    return batch


def algorithm_steps(ckpt_dir: str, rollout: dict, token_advantages: torch.Tensor, first: int, count: int,
                    names, dispatcher: str = "alltoall", distributed_optimizer: bool = False):
    """Each of ``names`` (ALGORITHMS) as one update step on rows [first, first + count) of the same loaded weights:
    one model built for routing record/replay, Adam at lr 0 so no step moves it.
    Returns ({name: (out, sharded grads)}, the model, its optimizer, the drifted routing)."""
    ddp, optimizer = build(ckpt_dir, dispatcher, distributed_optimizer, lr=0.0, routing_replay=True)
    routing = drifted_routing(ddp, rollout, first, count)
    results = {}
    for name in names:
        batch = algorithm_batch(name, rollout, token_advantages)
        micro = micro_batches(batch, first, count, MICRO)
        for i, mb in enumerate(micro):
            if name in ("grpo_routing_replay", "gspo_volatility"):  # replayed, or compared (expert volatility)
                mb["old_routing"] = routing[i * MICRO:(i + 1) * MICRO]
            if name == "gspo_rollout_routing":  # this rank's rows, whole sequences: the forward step splits them
                mb["rollout_routing"] = rollout_routes()[first + i * MICRO:first + (i + 1) * MICRO]
        out = update_step(ddp, optimizer, micro, ALGORITHMS[name], replay_old_routing=name == "grpo_routing_replay")
        results[name] = (out, tiny.grads_sharded_state_dict(ddp.module))
    return results, ddp, optimizer, routing


def metrics_diff(stats: torch.Tensor, expected: torch.Tensor, unit: str) -> float:
    """The largest difference of any logged metric (algo.update_metrics) between two minibatches' stats."""
    got, want = update_metrics(stats, unit), update_metrics(expected, unit)
    got.update(correction_metrics(stats))
    want.update(correction_metrics(expected))
    return max(abs(got[k] - want[k]) for k in want)


def build(ckpt_dir: str, dispatcher: str = "alltoall", distributed_optimizer: bool = False, clip_grad: float = 1.0,
          lr: float = 1e-3, adam_eps: float = 1e-6, routing_replay: bool = False):
    """The world=1 weights under this rank's layout, built as the trainer builds a model it loads (no init)."""
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = tiny.build_model(dispatcher, seed=1 + torch.distributed.get_rank(), per_sequence_loss=True, init=False,
                             routing_replay=routing_replay)
    loaded = dist_checkpointing.load(tiny.tensors_only(model.sharded_state_dict()), f"{ckpt_dir}/weights")
    model.load_state_dict(loaded)
    ddp = tiny.wrap_ddp(model, distributed_optimizer)
    config = OptimizerConfig(optimizer="adam", lr=lr, adam_eps=adam_eps, weight_decay=0.0, clip_grad=clip_grad,
                             use_distributed_optimizer=distributed_optimizer)
    return ddp, get_megatron_optimizer(config, [ddp])


def clipped_step(ckpt_dir: str, rollout: dict, first: int, count: int, clip_grad: float, **build_args):
    """One update clipped to ``clip_grad`` (below the gradient norm) with Adam's eps at 1: the first step is then
    lr * g / (|g| + 1), nearly linear in the clipped gradient, so a wrong global norm shows in the weights (with a
    small eps Adam's first step is ~lr * sign(g) and hides the gradient's scale). lr 1: steps far above fp32's
    rounding of the weights. Returns (out, ddp model)."""
    ddp, optimizer = build(ckpt_dir, clip_grad=clip_grad, lr=1.0, adam_eps=1.0, **build_args)
    return update_step(ddp, optimizer, micro_batches(rollout, first, count, MICRO), ALGO), ddp


def reference(ckpt_dir: str):
    """world=1: weights, rollout (old log-probs from the model, perturbed), then the step's results."""
    from megatron.core import dist_checkpointing

    for name in ("weights", "grads", "updated"):
        os.makedirs(f"{ckpt_dir}/{name}")
    model = tiny.build_model(per_sequence_loss=True)
    dist_checkpointing.save(tiny.tensors_only(model.sharded_state_dict()), f"{ckpt_dir}/weights")
    ddp, optimizer = build(ckpt_dir)
    rollout = make_rollout()
    passes = logprob_pass(ddp, micro_batches(rollout, 0, NUM_SEQUENCES, MICRO), with_entropy=True)
    # pi_old differs from pi_theta by ~1e-3 per token, so some sequences fall outside 1 +- 4e-4 and clip.
    noise = 1e-3 * torch.randn(passes["logprobs"].shape, generator=torch.Generator().manual_seed(3))
    rollout["old_logprobs"] = passes["logprobs"] + noise
    gap = ENGINE_GAP * torch.randn(passes["logprobs"].shape, generator=torch.Generator().manual_seed(4))
    rollout["rollout_logprobs"] = rollout["old_logprobs"] + gap
    torch.save(rollout, f"{ckpt_dir}/rollout.pt")
    torch.save(passes, f"{ckpt_dir}/passes.pt")
    # GSPO-token's per-token advantages: the sequence's plus token noise, on response tokens.
    noise = 0.5 * torch.randn(rollout["loss_mask"].shape, generator=torch.Generator().manual_seed(5))
    token_advantages = (rollout["advantages"].unsqueeze(1) + noise) * rollout["loss_mask"]
    torch.save(token_advantages, f"{ckpt_dir}/token_advantages.pt")

    before = {k: v.clone() for k, v in tiny.flat(tiny.tensors_only(ddp.module.sharded_state_dict())).items()}
    out = update_step(ddp, optimizer, micro_batches(rollout, 0, NUM_SEQUENCES, MICRO), ALGO)
    after = tiny.flat(tiny.tensors_only(ddp.module.sharded_state_dict()))
    moved = min((after[k] - before[k]).abs().max().item() for k in before)
    grads = tiny.grads_sharded_state_dict(ddp.module)
    dist_checkpointing.save(grads, f"{ckpt_dir}/grads")
    dist_checkpointing.save(tiny.tensors_only(ddp.module.sharded_state_dict()), f"{ckpt_dir}/updated")
    torch.save(out, f"{ckpt_dir}/outputs.pt")

    # The same minibatch as 1, 2 or 4 micro batches gives the same gradient.
    split = {}
    for size in (8, 4, 2):
        ddp, optimizer = build(ckpt_dir)
        update_step(ddp, optimizer, micro_batches(rollout, 0, NUM_SEQUENCES, size), ALGO)
        split[size] = tiny.flat(tiny.grads_sharded_state_dict(ddp.module))
    # Uneven micro batches too (what token-budget micro batches make: 3, 1 and 4 sequences).
    ddp, optimizer = build(ckpt_dir)
    uneven = [{k: v[rows] for k, v in rollout.items()} for rows in (slice(0, 3), slice(3, 4), slice(4, 8))]
    update_step(ddp, optimizer, uneven, ALGO)
    split["uneven"] = tiny.flat(tiny.grads_sharded_state_dict(ddp.module))
    split_diff = max(tiny.max_rel_diff(split[s][k], split[2][k]) for s in (8, 4, "uneven") for k in split[2])
    # The log-prob pass must see exactly the log-probs the loss sees: with old = pass, every ratio is 1.
    same = dict(rollout, old_logprobs=passes["logprobs"])
    ddp, optimizer = build(ckpt_dir)
    ratio_one = update_step(ddp, optimizer, micro_batches(same, 0, NUM_SEQUENCES, MICRO), ALGO)["seq_log_ratio"]
    # An entropy bonus lowers the loss by entropy_coef x the mean over sequences of each one's mean token entropy
    # (from the log-prob pass) and changes the gradient; the ratios are untouched.
    ddp, optimizer = build(ckpt_dir)
    bonus = update_step(ddp, optimizer, micro_batches(rollout, 0, NUM_SEQUENCES, MICRO),
                        dataclasses.replace(ALGO, entropy_coef=ENTROPY_COEF))
    bonus_grads = tiny.flat(tiny.grads_sharded_state_dict(ddp.module))
    mask = rollout["loss_mask"].float()
    per_sequence = (passes["entropy"] * mask).sum(1) / mask.sum(1).clamp_min(1)
    entropy = {
        "loss_gap": (bonus["loss"] - out["loss"]).item(),
        "expected_gap": -ENTROPY_COEF * per_sequence.sum().item() / out["valid"].sum().item(),
        "ratio_diff": (bonus["seq_log_ratio"] - out["seq_log_ratio"]).abs().max().item(),
        "grad_change": max(tiny.max_rel_diff(bonus_grads[k], split[2][k]) for k in bonus_grads),
    }
    # The fused loss (the default) equals the log-prob op followed by the loss, with and without the entropy term.
    unfused = {}
    for name, cfg, expected, expected_grads in (("plain", ALGO, out, split[2]),
                                                ("entropy", dataclasses.replace(ALGO, entropy_coef=ENTROPY_COEF),
                                                 bonus, bonus_grads)):
        ddp, optimizer = build(ckpt_dir)
        got = update_step(ddp, optimizer, micro_batches(rollout, 0, NUM_SEQUENCES, MICRO),
                          dataclasses.replace(cfg, fused_loss=False))
        grads = tiny.flat(tiny.grads_sharded_state_dict(ddp.module))
        unfused[name] = {
            "loss": abs(got["loss"].item() - expected["loss"].item()) / abs(expected["loss"].item()),
            "ratio": (got["seq_log_ratio"] - expected["seq_log_ratio"]).abs().max().item(),
            "grads": max(tiny.max_rel_diff(grads[k], expected_grads[k]) for k in grads),
        }
    # A clipped step, saved as the updated weights: the layouts must clip by the same global norm.
    clip_grad = 0.5 * out["grad_norm"]
    clipped, ddp = clipped_step(ckpt_dir, rollout, 0, NUM_SEQUENCES, clip_grad)
    os.makedirs(f"{ckpt_dir}/clipped")
    dist_checkpointing.save(tiny.tensors_only(ddp.module.sharded_state_dict()), f"{ckpt_dir}/clipped")
    torch.save({"clip_grad": clip_grad, "grad_norm": clipped["grad_norm"]}, f"{ckpt_dir}/clipped.pt")
    # The other algorithms on the same weights, saved for the layouts to compare with.
    algos, ddp, optimizer, drifted = algorithm_steps(ckpt_dir, rollout, token_advantages, 0, NUM_SEQUENCES, ALGORITHMS)
    for name, (_, grads) in algos.items():
        os.makedirs(f"{ckpt_dir}/grads_{name}")
        dist_checkpointing.save(grads, f"{ckpt_dir}/grads_{name}")
    torch.save({name: o for name, (o, _) in algos.items()}, f"{ckpt_dir}/algorithms.pt")
    # GSPO-token with the sequence advantage on every token is GSPO: loss, clipping and gradient.
    same_weights = {}
    for name, cfg in (("gspo", ALGO), ("gspo_token", LossConfig(name="gspo_token"))):
        o = update_step(ddp, optimizer, micro_batches(rollout, 0, NUM_SEQUENCES, MICRO), cfg)
        same_weights[name] = (o, tiny.flat(tiny.grads_sharded_state_dict(ddp.module)))
    (gspo, gspo_grads), (token, token_grads) = same_weights["gspo"], same_weights["gspo_token"]
    broadcast = {
        "loss": abs(token["loss"].item() - gspo["loss"].item()) / abs(gspo["loss"].item()),
        "grads": max(tiny.max_rel_diff(token_grads[k], gspo_grads[k]) for k in gspo_grads),
        "clipped_tokens": (token["stats"] - gspo["stats"]).abs().max().item(),
        "clip_frac_tokens": update_metrics(gspo["stats"], "sequence")["clip_frac_tokens"],
    }
    # Expert volatility counted by the update equals the record compared by hand with a fresh pass's routing.
    fresh = logprob_pass(ddp, micro_batches(rollout, 0, NUM_SEQUENCES, MICRO), record_old_routing=True)["old_routing"]
    volatility = {"update": algos["gspo_volatility"][0]["routing_changes"].tolist(),
                  "by_hand": routing_changes(drifted, fresh, rollout["loss_mask"]).tolist()}
    # After the volatility check: building models registers routers for replay anew.
    corrected = corrected_properties(ckpt_dir, rollout, token_advantages, passes, algos)
    return {"out": out, "split_diff": split_diff, "ratio_one": ratio_one, "moved": moved, "entropy": entropy,
            "unfused": unfused, "clipped_norm": clipped["grad_norm"], "broadcast": broadcast,
            "volatility": volatility, "algorithms": {name: o for name, (o, _) in algos.items()},
            "corrected": corrected}


def corrected_properties(ckpt_dir: str, rollout: dict, token_advantages: torch.Tensor, passes: dict,
                         algos: dict) -> dict:
    """World 1: each corrected loss against the pure function on the log-prob pass's log-probs (the update's
    weights: lr 0), the unfused loss against the fused, and what each correction did (its metrics)."""
    out = {}
    logprobs, mask = passes["logprobs"].double(), rollout["loss_mask"]
    losses = {"gspo": gspo_loss, "gspo_token": gspo_token_loss, "grpo": grpo_loss}
    for name in CORRECTED:
        cfg = ALGORITHMS[name]
        got, grads = algos[name]
        batch = algorithm_batch(name, rollout, token_advantages)
        advantages, old = batch["advantages"], batch["old_logprobs"]
        target = logprobs if cfg.reuse_rollout_logprobs else old
        corrected, kept, _ = rollout_correction(target.double(), rollout["rollout_logprobs"].double(), mask,
                                                advantages.double(), cfg.correction, cfg.name == "gspo")
        eps = (cfg.eps_low, cfg.eps_high)
        expected = losses[cfg.name](logprobs, old.double(), corrected, kept, *eps)[0].item()
        ddp, optimizer = build(ckpt_dir, lr=0.0, routing_replay=True)
        unfused = update_step(ddp, optimizer, micro_batches(batch, 0, NUM_SEQUENCES, MICRO),
                              dataclasses.replace(cfg, fused_loss=False))
        unfused_grads = tiny.flat(tiny.grads_sharded_state_dict(ddp.module))
        grads = tiny.flat(grads)
        out[name] = {
            "pure": abs(got["loss"].item() - expected) / abs(expected),
            "unfused_loss": abs(unfused["loss"].item() - got["loss"].item()) / abs(got["loss"].item()),
            "unfused_grads": max(tiny.max_rel_diff(unfused_grads[k], grads[k]) for k in grads),
            "metrics": correction_metrics(got["stats"]),
        }
    return out


def compare(ckpt_dir: str, cases) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from gspo_megatron.parallel import groups

    ref = torch.load(f"{ckpt_dir}/outputs.pt")
    rollout = torch.load(f"{ckpt_dir}/rollout.pt")
    clipped_ref = torch.load(f"{ckpt_dir}/clipped.pt")
    ref_passes = torch.load(f"{ckpt_dir}/passes.pt")
    ref_algos = torch.load(f"{ckpt_dir}/algorithms.pt")
    token_advantages = torch.load(f"{ckpt_dir}/token_advantages.pt")
    results = {}
    for name, layout, dispatcher, distributed_optimizer in cases:
        groups.init_model_parallel(layout)
        ddp, optimizer = build(ckpt_dir, dispatcher, distributed_optimizer)
        per_dp = NUM_SEQUENCES // ps.get_data_parallel_world_size()
        first = ps.get_data_parallel_rank() * per_dp
        # The old-policy pass: whole sequences' per-token results on every rank (gathered back under CP).
        passes = logprob_pass(ddp, micro_batches(rollout, first, per_dp, MICRO), with_entropy=True)
        pass_diff = max((passes[k] - ref_passes[k][first:first + per_dp]).abs().max().item()
                        for k in ("logprobs", "entropy", "seq_logprob", "num_tokens"))
        out = update_step(ddp, optimizer, micro_batches(rollout, first, per_dp, MICRO), ALGO)
        ref_grads = tiny.flat(dist_checkpointing.load(tiny.empty_like_sharded(ddp.module), f"{ckpt_dir}/grads"))
        ref_weights = tiny.flat(dist_checkpointing.load(tiny.empty_like_sharded(ddp.module), f"{ckpt_dir}/updated"))
        grads = tiny.flat(tiny.grads_sharded_state_dict(ddp.module))
        weights = tiny.flat(tiny.tensors_only(ddp.module.sharded_state_dict()))
        results[name] = {
            "loss": abs(out["loss"].item() - ref["loss"].item()) / abs(ref["loss"].item()),
            # Every rank holds the whole minibatch's per-sequence stats (gathered over DP), as world=1 does.
            "seq_log_ratio": (out["seq_log_ratio"] - ref["seq_log_ratio"]).abs().max().item(),
            "stats": (out["stats"] - ref["stats"]).abs().max().item(),
            "metrics": metrics_diff(out["stats"], ref["stats"], "sequence"),
            # With the distributed optimizer each DP rank holds only its reduce-scattered slice of the grad
            # buffer, so the full gradients are not there to compare; the updated weights (all-gathered) are.
            "grads": None if distributed_optimizer else max(tiny.max_rel_diff(grads[k], ref_grads[k]) for k in grads),
            "weights": max((weights[k] - ref_weights[k]).abs().max().item() for k in weights),
            "grad_norm": abs(out["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"],
            "logprob_pass": pass_diff,
            "update_successful": out["update_successful"],
        }
        clipped, ddp = clipped_step(ckpt_dir, rollout, first, per_dp, clipped_ref["clip_grad"], dispatcher=dispatcher,
                                    distributed_optimizer=distributed_optimizer)
        start = tiny.flat(dist_checkpointing.load(tiny.empty_like_sharded(ddp.module), f"{ckpt_dir}/weights"))
        ref_end = tiny.flat(dist_checkpointing.load(tiny.empty_like_sharded(ddp.module), f"{ckpt_dir}/clipped"))
        end = tiny.flat(tiny.tensors_only(ddp.module.sharded_state_dict()))
        # The step relative to the largest step of any weight: a wrong clip coefficient scales every step.
        scale = max((ref_end[k] - start[k]).abs().max().item() for k in start)
        results[name]["clipped_step"] = max(((end[k] - start[k]) - (ref_end[k] - start[k])).abs().max().item()
                                            for k in start) / scale
        results[name]["clipped_grad_norm"] = abs(clipped["grad_norm"] - clipped_ref["grad_norm"]) / clipped_ref["grad_norm"]

        names = CP_ALGORITHMS if layout.context > 1 else tuple(ALGORITHMS)
        algos, ddp, _, _ = algorithm_steps(ckpt_dir, rollout, token_advantages, first, per_dp, names, dispatcher,
                                           distributed_optimizer)
        for algo_name, (got, grads) in algos.items():
            want = ref_algos[algo_name]
            r = {
                "loss": abs(got["loss"].item() - want["loss"].item()) / abs(want["loss"].item()),
                "stats": (got["stats"] - want["stats"]).abs().max().item(),
                "metrics": metrics_diff(got["stats"], want["stats"], ALGORITHMS[algo_name].unit),
                "grad_norm": abs(got["grad_norm"] - want["grad_norm"]) / want["grad_norm"],
                "update_successful": got["update_successful"],
                "grads": None,
            }
            if not distributed_optimizer:
                ref_grads = tiny.flat(dist_checkpointing.load(tiny.empty_like_sharded(ddp.module),
                                                              f"{ckpt_dir}/grads_{algo_name}"))
                grads = tiny.flat(grads)
                r["grads"] = max(tiny.max_rel_diff(grads[k], ref_grads[k]) for k in grads)
            if "routing_changes" in want:
                r["routing_changes"] = (got["routing_changes"] - want["routing_changes"]).abs().tolist()
            results[f"{name}/{algo_name}"] = r
    return results


_reference_cache: dict = {}


def reference_dir(tmp_path_factory) -> tuple[str, dict]:
    if not _reference_cache:
        ckpt_dir = str(tmp_path_factory.mktemp("policy_reference"))
        (result,) = run_on_ranks(reference, 1, Layout(), ckpt_dir)
        _reference_cache.update(dir=ckpt_dir, result=result)
    return _reference_cache["dir"], _reference_cache["result"]


def _check_algorithms(results, cases):
    for name, layout, *_ in cases:
        names = CP_ALGORITHMS if layout.context > 1 else tuple(ALGORITHMS)
        for rank, res in enumerate(results):
            for algo_name in names:
                r, where = res[f"{name}/{algo_name}"], f"{name}/{algo_name} rank {rank}"
                rtol, stats_atol = ALGORITHM_TOLERANCE.get(algo_name, (RTOL, STATS_ATOL))
                assert r["update_successful"], where
                assert r["loss"] <= rtol, f"{where}: loss rel diff {r['loss']:.2e}"
                assert r["stats"] <= stats_atol, f"{where}: per-sequence stats abs diff {r['stats']:.2e}"
                assert r["metrics"] <= stats_atol, f"{where}: logged metrics abs diff {r['metrics']:.2e}"
                assert r["grad_norm"] <= rtol, f"{where}: grad norm rel diff {r['grad_norm']:.2e}"
                if r["grads"] is not None:
                    assert r["grads"] <= rtol, f"{where}: grads rel diff {r['grads']:.2e}"
                if "routing_changes" in r:
                    # (changed, decisions) summed over all ranks: the same tokens and layers, the same experts.
                    assert r["routing_changes"] == [0.0, 0.0], f"{where}: routing changes differ {r['routing_changes']}"


def _check(results, cases):
    _check_algorithms(results, cases)
    for name, *_ in cases:
        for rank, r in enumerate(res[name] for res in results):
            where = f"{name} rank {rank}"
            assert r["update_successful"], where
            assert r["loss"] <= RTOL, f"{where}: loss rel diff {r['loss']:.2e}"
            assert r["seq_log_ratio"] <= RATIO_ATOL, f"{where}: seq log-ratio abs diff {r['seq_log_ratio']:.2e}"
            assert r["stats"] <= STATS_ATOL, f"{where}: per-sequence stats abs diff {r['stats']:.2e}"
            assert r["metrics"] <= STATS_ATOL, f"{where}: logged metrics abs diff {r['metrics']:.2e}"
            if r["grads"] is not None:
                assert r["grads"] <= RTOL, f"{where}: grads rel diff {r['grads']:.2e}"
            assert r["weights"] <= WEIGHT_ATOL, f"{where}: updated weights abs diff {r['weights']:.2e}"
            assert r["logprob_pass"] <= PASS_ATOL, f"{where}: log-prob pass abs diff {r['logprob_pass']:.2e}"
            # What users see: the logged gradient norm, and the step clipping makes with it.
            assert r["grad_norm"] <= RTOL, f"{where}: grad norm rel diff {r['grad_norm']:.2e}"
            assert r["clipped_grad_norm"] <= RTOL, f"{where}: clipped step's grad norm rel diff {r['clipped_grad_norm']:.2e}"
            assert r["clipped_step"] <= CLIPPED_RTOL, f"{where}: clipped step rel diff {r['clipped_step']:.2e}"


@pytest.mark.megatron  # builds a Megatron model
def test_world1_reference_properties(tmp_path_factory):
    _, result = reference_dir(tmp_path_factory)
    out = result["out"]
    assert result["split_diff"] <= 1e-6, f"1/2/4/uneven micro batches: grads rel diff {result['split_diff']:.2e}"
    torch.testing.assert_close(result["ratio_one"][out["valid"]], torch.zeros(int(out["valid"].sum())), rtol=0, atol=1e-6)
    # Every tensor moved by far more than the layouts' weight tolerance, so that comparison has teeth.
    assert result["moved"] > 100 * WEIGHT_ATOL, result["moved"]
    assert out["grad_norm"] > 0
    # The clipped step saw the same gradients (its norm is measured before clipping).
    assert abs(result["clipped_norm"] - out["grad_norm"]) <= RTOL * out["grad_norm"], result["clipped_norm"]
    assert not out["valid"][5] and out["valid"].sum() == NUM_SEQUENCES - 1
    # The perturbed old policy clips some sequences but not all: both GSPO branches are exercised.
    assert 0 < update_metrics(out["stats"], "sequence")["clip_frac"] < 1
    entropy = result["entropy"]
    assert entropy["expected_gap"] < -0.1, entropy  # the tiny model's entropy is ~log(vocab): a large bonus
    assert abs(entropy["loss_gap"] - entropy["expected_gap"]) <= 1e-5 * abs(entropy["expected_gap"]), entropy
    assert entropy["ratio_diff"] <= 1e-6 and entropy["grad_change"] > 1e-3, entropy
    for name, diff in result["unfused"].items():
        assert diff["loss"] <= RTOL and diff["ratio"] <= RATIO_ATOL and diff["grads"] <= RTOL, (name, diff)


@pytest.mark.megatron  # checks the Megatron model's results (a session fixture built it)
def test_world1_algorithm_properties(tmp_path_factory):
    ckpt_dir, result = reference_dir(tmp_path_factory)
    # GSPO-token with A_i on every token is GSPO in loss, gradient and clipping (some of it clipped).
    same = result["broadcast"]
    assert same["loss"] <= 1e-6 and same["grads"] <= 1e-6 and same["clipped_tokens"] == 0.0, same
    assert same["clip_frac_tokens"] > 0, same
    algos = result["algorithms"]
    loss = {name: o["loss"].item() for name, o in algos.items()}
    # Each token-level loss clips some tokens but not all, so the layouts' comparisons cover both branches.
    for name in ("grpo", "grpo_seq_mean", "gspo_token", "grpo_routing_replay"):
        assert 0 < update_metrics(algos[name]["stats"], "token")["clip_frac_tokens"] < 1, name
    # The variants are different losses: aggregation, per-token advantages and replayed experts each change it.
    assert abs(loss["grpo_seq_mean"] - loss["grpo"]) > 1e-3 * abs(loss["grpo"]), loss
    assert abs(loss["gspo_token"] - loss["gspo_volatility"]) > 1e-3 * abs(loss["gspo_volatility"]), loss
    assert abs(loss["grpo_routing_replay"] - loss["grpo"]) > 1e-4 * abs(loss["grpo"]), loss
    assert abs(loss["gspo_rollout_routing"] - loss["gspo_volatility"]) > 1e-4 * abs(loss["gspo_volatility"]), loss
    # Expert volatility: the update's count equals the record compared by hand with a fresh pass, over every
    # (response-predicting token, layer); the drifted routers changed some decisions, not all.
    volatility = result["volatility"]
    assert volatility["update"] == volatility["by_hand"], volatility
    changed, decisions = volatility["update"]
    rollout = torch.load(f"{ckpt_dir}/rollout.pt")
    assert decisions == 2 * rollout["loss_mask"].sum().item(), volatility  # 2 MoE layers
    assert 0.05 < changed / decisions < 0.95, volatility


@pytest.mark.megatron  # checks the Megatron model's results (a session fixture built it)
def test_world1_corrections_equal_the_pure_function(tmp_path_factory):
    _, result = reference_dir(tmp_path_factory)
    for name, r in result["corrected"].items():
        # fp32 log-probs through Megatron against the float64 pure function on the pass's (fp32) log-probs.
        assert r["pure"] <= 1e-5, (name, r)
        assert r["unfused_loss"] <= RTOL and r["unfused_grads"] <= RTOL, (name, r)
        m = r["metrics"]
        # Each correction acts on some of the batch but not all of it, so the layouts compare both branches.
        acted = {"gspo_corrected": m["correction_truncated_tokens"] + m["correction_rejected_tokens"],
                 "gspo_token_corrected": m["correction_masked_tokens"],
                 "grpo_corrected": m["correction_truncated_tokens"] + m["correction_rejected_tokens"],
                 "gspo_bypass_corrected": m["correction_masked_tokens"] + m["correction_rejected_tokens"]}[name]
        assert 0 < acted and m["correction_rejected_seqs"] < 1, (name, m)


TWO = [
    ("tp2", Layout(tensor=2, sequence_parallel=True), "alltoall", False),
    ("pp2", Layout(pipeline=2), "alltoall", False),
    ("ep2", Layout(expert=2), "alltoall", True),
    # The model path under context parallelism: batch split, RoPE slices, CP sums, DP x CP gradient reduction
    # (attention: tests/cp_attention.py, standing in for TransformerEngine's).
    ("cp2", Layout(context=2), "alltoall", False),
]
FOUR = [
    ("tp2_ep2", Layout(tensor=2, expert=2, sequence_parallel=True), "alltoall", False),
    ("pp2_ep2", Layout(pipeline=2, expert=2), "allgather", True),
    ("tp2_cp2", Layout(tensor=2, context=2, sequence_parallel=True), "alltoall", False),
]


@pytest.mark.megatron  # builds a Megatron model
def test_two_rank_update_steps_equal_world1(tmp_path_factory):
    ckpt_dir, _ = reference_dir(tmp_path_factory)
    _check(run_on_ranks(compare, 2, None, ckpt_dir, TWO), TWO)


@pytest.mark.megatron  # builds a Megatron model
def test_four_rank_update_steps_equal_world1(tmp_path_factory):
    ckpt_dir, _ = reference_dir(tmp_path_factory)
    _check(run_on_ranks(compare, 4, None, ckpt_dir, FOUR), FOUR)
