"""Packed sequences (``parallel.pack_sequences``) equal padded rows, on the model path and under every layout.

The packing functions against hand-built expectations; then, on the tiny MoE (local spec: the block-diagonal
mask path), the same rollout of 8 sequences of 5-16 tokens (garbage after each sequence's end, which causal
attention keeps out of the padded path) in micro batches of 2, padded and packed, on the same weights:
the log-prob pass (log-probs and entropies on every real position, sequence sums), a GSPO update (loss,
per-sequence stats, every gradient, gradient norm), GRPO + Routing Replay of experts recorded (packed, and padded)
under drifted routers, GRPO + rollout routing replay of an engine's routes (packed with the tokens), expert
volatility (the update's routing against that record), and GSPO with a rollout correction (geometric weights
truncated, rejection by max |log w|: whole-sequence sums of the unpacked rows, reduced over CP ranks). At world=1 and in one
2-rank launch: TP2 + SP, PP2, EP2. Tolerances: RoPE runs over the packed row's positions, so queries and keys
rotate by different angles than padded (relative positions, hence scores, equal up to rounding): log-probs 2e-5
absolute (fp32, values ~5), loss 1e-6 absolute (a mean of advantage-weighted ratios ~1 that nearly cancel),
gradient norm 1e-5 relative, gradients 1e-5 relative (max |a-e| / max |e|);
routing decisions and token counts exactly.

Through the trainer (``train.update.passes``, the policy built from a tiny HF Qwen3-MoE, two data-parallel ranks and
then PP2, 2 minibatches at lr 0): padded rows, packed rows (DP2), and packed token-budget micro batches
(``parallel.max_tokens_per_micro_batch``: other groupings than the fixed split, the count agreed over DP ranks) give
the same old-policy pass, loss, gradient norm, update metrics and the second minibatch's gradients, for GSPO (with expert
volatility) and GRPO + Routing Replay, each with a rollout correction (geometric, token): the per-sequence normalisation is exact for token-budget splits too (1e-5
relative). Under PP2 rank 0 also gathers every stage's HF tensors (``train.weight_sync.pipeline.pipeline_gathered``).
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.algo import Correction, correction_metrics, group_advantages
from gspo_megatron.parallel import packing
from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.train.update.loss import LossConfig
from gspo_megatron.train.update.schedules import logprob_pass, update_step
from tests import megatron_tiny as tiny

NUM_SEQUENCES, GROUP, MICRO = 8, 4, 2
LOGPROB_ATOL, RTOL, GRAD_RTOL = 2e-5, 1e-5, 1e-5
# The losses are means of advantage-weighted ratios (terms ~1) that nearly cancel: compared absolutely.
LOSS_ATOL = 1e-6
GSPO = LossConfig(eps_low=3e-4, eps_high=4e-4)
GRPO = LossConfig(name="grpo", eps_low=1e-3, eps_high=1e-3)
# Under context parallelism only GSPO's terms reduce over CP ranks: the replay cases run it, with GRPO's clipping.
GSPO_REPLAY = LossConfig(eps_low=1e-3, eps_high=1e-3)
GSPO_CORRECTED = LossConfig(eps_low=3e-4, eps_high=4e-4, correction=Correction(level="geometric", high=1.01,
                                                                               rejection="max", rejection_high=0.12))


def test_pack_and_unpack():
    lengths = torch.tensor([3, 1, 2])
    ids = torch.tensor([[1, 2, 3, 9], [4, 9, 9, 9], [5, 6, 9, 9]])
    routes = torch.stack([ids, ids + 20], dim=-1).unsqueeze(2)  # [b, S, L=1, k=2]
    packed = packing.pack({"input_ids": ids, "labels": ids + 10, "seq_lengths": lengths, "rollout_routing": routes},
                          length=8)
    # each token's routes go with it; the padding tail gets k distinct experts
    assert packed["rollout_routing"][0, :, 0].tolist() == [[1, 21], [2, 22], [3, 23], [4, 24], [5, 25], [6, 26],
                                                           [0, 1], [0, 1]]
    assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 0, 0]]
    assert packed["labels"].tolist() == [[11, 12, 13, 14, 15, 16, 0, 0]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 0, 1]]
    assert packed["cu_seqlens"].tolist() == [0, 3, 4, 6, 8] and packed["max_seqlen"] == 3
    assert packing.packed_length(lengths, 4) == 8 and packing.packed_length(lengths, 1) == 6
    assert packing.unpack(packed["input_ids"], packed["unpack_index"]).tolist() == [[1, 2, 3, 3], [4, 4, 4, 4],
                                                                                     [5, 6, 6, 6]]
    back = packing.pack_rows(ids.unsqueeze(-1), packed["unpack_index"], 8)
    assert back[..., 0].tolist() == [[1, 2, 3, 4, 5, 6, 0, 0]]
    mask = packing.block_causal_mask(packed["cu_seqlens"], 8)[0, 0]
    visible = [(~mask[q]).nonzero().flatten().tolist() for q in range(8)]
    assert visible == [[0], [0, 1], [0, 1, 2], [3], [4], [4, 5], [6], [6, 7]]
    # ... and the segments read back from it (what the gated DeltaNet restarts at); a plain causal row has one
    assert packing.mask_segments(packing.block_causal_mask(packed["cu_seqlens"], 8)).tolist() == [0, 3, 4, 6, 8]
    assert packing.mask_segments(packing.block_causal_mask(torch.tensor([0, 8]), 8)) is None
    # The unpacked values carry gradients back to their packed positions.
    row = torch.arange(8.0, requires_grad=True)
    packing.unpack(row.unsqueeze(0), packed["unpack_index"])[:, 0].sum().backward()
    assert row.grad.tolist() == [1, 0, 0, 1, 1, 0, 0, 0]


def make_rollout() -> dict:
    g = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, tiny.VOCAB, (NUM_SEQUENCES, tiny.SEQ + 1), generator=g)
    lengths = torch.randint(5, tiny.SEQ + 1, (NUM_SEQUENCES,), generator=g)
    lengths[2] = tiny.SEQ
    prompt = torch.randint(2, 5, (NUM_SEQUENCES,), generator=g)
    t = torch.arange(tiny.SEQ).unsqueeze(0)
    # label t is token t+1: a response token when prompt <= t+1 < length
    loss_mask = (t + 1 >= prompt.unsqueeze(1)) & (t + 1 < lengths.unsqueeze(1))
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask,
            "advantages": group_advantages(torch.rand(NUM_SEQUENCES, generator=g), GROUP), "seq_lengths": lengths}


def micro_batches(rollout: dict, first: int, count: int, routing=None, key="old_routing") -> list[dict]:
    out = []
    for i in range(first, first + count, MICRO):
        mb = {k: v[i:i + MICRO] for k, v in rollout.items()}
        if routing is not None:
            mb[key] = routing[i - first:i - first + MICRO]
        out.append(mb)
    return out


def _routers(ddp):
    return [layer.mlp.router for layer in tiny.unwrap_layers(ddp)]


def _drifted_routing(ddp, rollout, first, count, pack):
    saved = [r.weight.detach().clone() for r in _routers(ddp)]
    with torch.no_grad():
        for layer, router in zip(tiny.unwrap_layers(ddp), _routers(ddp)):
            noise = torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(layer.layer_number))
            router.weight.add_(0.5 * noise)
    routing = logprob_pass(ddp, micro_batches(rollout, first, count), record_old_routing=True, pack=pack)["old_routing"]
    with torch.no_grad():
        for router, weight in zip(_routers(ddp), saved):
            router.weight.copy_(weight)
    return routing


def compare(cases) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from gspo_megatron.parallel import groups

    rollout = make_rollout()
    results = {}
    for name, layout in cases:
        groups.init_model_parallel(layout)
        model = tiny.build_model(seed=5, per_sequence_loss=True, routing_replay=True)
        ddp = tiny.wrap_ddp(model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.0, clip_grad=1.0), [ddp])
        per_dp = NUM_SEQUENCES // ps.get_data_parallel_world_size()
        first = ps.get_data_parallel_rank() * per_dp
        rows = slice(first, first + per_dp)
        real = torch.arange(tiny.SEQ).unsqueeze(0) < rollout["seq_lengths"][rows].unsqueeze(1)
        passes = {pack: logprob_pass(ddp, micro_batches(rollout, first, per_dp), with_entropy=True, pack=pack)
                  for pack in (False, True)}
        r = {"pass": max((passes[True][k] - passes[False][k])[real].abs().max().item() for k in ("logprobs", "entropy")),
             "pass_sums": max((passes[True][k] - passes[False][k]).abs().max().item()
                              for k in ("seq_logprob", "num_tokens"))}
        noise = 1e-3 * torch.randn(rollout["loss_mask"].shape, generator=torch.Generator().manual_seed(3))
        # pi_old: the padded pass (every layout's own weights) perturbed, on every rank the same rows
        old = torch.zeros_like(noise)
        old[rows] = passes[False]["logprobs"].cpu()
        batch = dict(rollout, old_logprobs=old + noise)
        # the engine's log-probs: pi_old's plus a bf16-sized gap
        gap = 0.05 * torch.randn(noise.shape, generator=torch.Generator().manual_seed(6))
        batch["rollout_logprobs"] = batch["old_logprobs"] + gap

        def step(cfg, pack, routing=None, key="old_routing", replay_old_routing=False):
            out = update_step(ddp, optimizer, micro_batches(batch, first, per_dp, routing, key), cfg, pack=pack,
                              replay_old_routing=replay_old_routing)
            return out, tiny.flat(tiny.grads_sharded_state_dict(ddp.module))

        def diff(a, b):
            (out_a, grads_a), (out_b, grads_b) = a, b
            return {"loss": abs(out_a["loss"].item() - out_b["loss"].item()),
                    "stats": (out_a["stats"] - out_b["stats"]).abs().max().item(),
                    "grads": max(tiny.max_rel_diff(grads_a[k], grads_b[k]) for k in grads_b),
                    "grad_norm": abs(out_a["grad_norm"] - out_b["grad_norm"]) / out_b["grad_norm"]}

        r["gspo"] = diff(step(GSPO, True), step(GSPO, False))
        corrected = {pack: step(GSPO_CORRECTED, pack) for pack in (False, True)}
        r["corrected"] = diff(corrected[True], corrected[False])
        r["corrected_metrics"] = correction_metrics(corrected[True][0]["stats"])
        drifted = {pack: _drifted_routing(ddp, batch, first, per_dp, pack) for pack in (False, True)}
        replay_algo = GRPO if layout.context == 1 else GSPO_REPLAY
        free = step(replay_algo, False)
        replayed = {pack: step(replay_algo, pack, drifted[pack], replay_old_routing=True) for pack in (False, True)}
        r["replay"] = diff(replayed[True], replayed[False])
        r["replay_changes"] = diff(replayed[False], free)["stats"]  # per-sequence log-ratio sums
        # Rollout routing replay: an engine's experts for every layer of the whole sequence [N, S, L, k], packed
        # with the tokens (each rank's routers then take their stage's layers and sequence-parallel share).
        routes = torch.rand(NUM_SEQUENCES, tiny.SEQ, 2, 4, generator=torch.Generator().manual_seed(4)).topk(2).indices
        engine = {pack: step(replay_algo, pack, routes[rows], "rollout_routing") for pack in (False, True)}
        r["r3"] = diff(engine[True], engine[False])
        r["r3_changes"] = diff(engine[False], free)["stats"]
        volatility = {pack: step(GSPO, pack, drifted[pack])[0]["routing_changes"].tolist()
                      for pack in (False, True)}
        r["volatility"] = volatility
        results[name] = r
    return results


def _check(results, cases):
    for rank, res in enumerate(results):
        for name, _ in cases:
            r, where = res[name], f"{name} rank {rank}"
            assert r["pass"] <= LOGPROB_ATOL and r["pass_sums"] <= LOGPROB_ATOL, (where, r)
            m = r["corrected_metrics"]  # the correction acts on some of the batch, not all of it
            assert 0 < m["correction_truncated_tokens"] + m["correction_rejected_tokens"], (where, m)
            assert m["correction_rejected_seqs"] < 1, (where, m)
            for key in ("gspo", "replay", "r3", "corrected"):
                d = r[key]
                assert d["loss"] <= LOSS_ATOL and d["grad_norm"] <= RTOL, (where, key, d)
                assert d["stats"] <= LOGPROB_ATOL and d["grads"] <= GRAD_RTOL, (where, key, d)
            assert r["replay_changes"] > 1e-3, (where, r)  # the replayed experts are not the free ones
            assert r["r3_changes"] > 1e-3, (where, r)
            packed, padded = r["volatility"][True], r["volatility"][False]
            assert packed == padded and 0 < packed[0] < packed[1], (where, r["volatility"])


WORLD1 = [("world1", Layout())]
TWO = [("tp2_sp", Layout(tensor=2, sequence_parallel=True)), ("pp2", Layout(pipeline=2)), ("ep2", Layout(expert=2)),
       ("cp2", Layout(context=2))]
FOUR = [("tp2_sp_cp2", Layout(tensor=2, context=2, sequence_parallel=True)), ("cp2_pp2", Layout(context=2, pipeline=2))]


@pytest.mark.megatron  # builds a Megatron model
def test_packed_equals_padded_world1():
    _check(run_on_ranks(compare, 1, None, WORLD1), WORLD1)


@pytest.mark.megatron  # builds a Megatron model
def test_packed_equals_padded_two_ranks():
    _check(run_on_ranks(compare, 2, None, TWO), TWO)


@pytest.mark.megatron  # builds a Megatron model
def test_packed_equals_padded_context_parallel_four_ranks():
    _check(run_on_ranks(compare, 4, None, FOUR), FOUR)


# ---- token-budget micro batches, through the trainer ----


def test_balance():
    lengths = torch.tensor([90, 10, 40, 60, 30, 200, 20])
    parts, loads = packing.balance(lengths, 3)
    assert sorted(torch.cat(parts).tolist()) == list(range(7)) and sum(loads) == int(lengths.sum())
    assert loads == [lengths[p].sum().item() for p in parts]
    # 450 tokens in budgets of 150: the 200-token sequence alone, the rest balanced into micro batches <= 150
    count = packing.smallest_count(lengths, 150)
    parts, loads = packing.balance(lengths, count)
    assert count == 3 and all(load <= 150 or p.numel() == 1 for p, load in zip(parts, loads)), (parts, loads)
    assert packing.smallest_count(lengths, 150, at_least=5) == 5
    assert packing.smallest_count(torch.tensor([5, 5]), 1) == 2  # every sequence over the budget: one each


SEQ = 96
BASE = ["data.task=reverse", "model.dtype=float32", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "algo.minibatches=2", "parallel.micro_batch_size=2", "parallel.distributed_optimizer=false",
        "optimizer.lr=0"]  # both minibatches on the same weights: Adam's ~lr * sign(g) would magnify rounding
PHASE_CASES = {
    "padded": [],
    "packed": ["parallel.pack_sequences=true"],
    # rows of 48-96 tokens: a DP2 share of 2 rows fits one micro batch or needs two (the count is agreed over
    # the ranks); PP2's 4-row minibatches split by tokens, not by 2 rows
    "budget": ["parallel.pack_sequences=true", "parallel.max_tokens_per_micro_batch=150"],
}
# Each with a rollout correction against the synthetic rollout's engine log-probs (far from the policy's: the weights
# are small, truncation changes nothing, the weighting does).
ALGOS = {"gspo": ["correction.level=geometric"],
         "grpo_replay": ["algo.name=grpo", "algo.routing_replay=old", "correction.level=token"]}


PHASE_LAYOUTS = {"dp2": [], "pp2": ["parallel.pipeline=2"]}


def run_phases(hf_dir: str) -> dict:
    """Each (layout, algorithm, batching) case on this rank: the old pass, two minibatch updates (at lr 0), the
    second one's gradients; under PP2 also the weights rank 0 gathers for the local engine / disk sync."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from gspo_megatron.parallel import groups
    from gspo_megatron.train.weight_sync import pipeline
    from gspo_megatron.train.update import passes
    from gspo_megatron.train.update.rows import micro_batch_rows, row_plan, sequence_lengths
    from gspo_megatron.train.startup.bootstrap import loss_config
    from gspo_megatron.train.startup.config import load_config
    from gspo_megatron.plan.probe import synthetic_rollout
    from gspo_megatron.train.startup.policy import build_policy, layout_of

    results = {}
    for layout_name, layout_overrides in PHASE_LAYOUTS.items():
        for algo_name, algo_overrides in ALGOS.items():
            for name, overrides in PHASE_CASES.items():
                if layout_name == "pp2" and name == "packed":
                    continue  # packed rows under PP2 are in the model-level launch; here the token budget
                cfg = load_config(None, BASE + layout_overrides + algo_overrides + overrides
                                  + [f"model.hf_dir={hf_dir}"])
                groups.init_model_parallel(layout_of(cfg))
                batch = synthetic_rollout(cfg, 128, SEQ, seed=4)
                RouterReplay.clear_global_router_replay_instances()  # one policy per process in the trainer
                policy = build_policy(cfg, hf_dir)
                rows = row_plan(batch["input_ids"].shape[0], cfg)
                plan = [[p.numel() for p in micro_batch_rows(batch, r, cfg)] for r in rows]
                metrics = {}
                old_routing = passes.old_logprobs(policy, batch, rows, cfg, loss_config(cfg), metrics)
                metrics.update(passes.update(policy, batch, rows, old_routing, cfg, loss_config(cfg)))
                grads = torch.cat([p.main_grad.detach().flatten().clone() for p in policy.model.parameters()])
                results[f"{layout_name}/{algo_name}/{name}"] = {
                    "metrics": metrics, "grads": grads, "plan": plan, "old": batch["old_logprobs"][batch["loss_mask"]],
                    "tokens": int(sequence_lengths(batch).sum()), "width": batch["input_ids"].shape[1]}
        if layout_name == "pp2":  # every stage's tensors reach rank 0 (the local engine's and disk sync's path)
            names = [n for n, _ in pipeline.pipeline_gathered(policy.bridge, policy.model)]
            results["pp2/gathered"] = (sorted(names), sorted(policy.bridge.hf_tensor_shapes()))
            # In bf16 a stage holds fp32 tensors too (megatron's torch norms): each must arrive in its own dtype.
            RouterReplay.clear_global_router_replay_instances()
            bf16 = build_policy(load_config(None, BASE + layout_overrides + [f"model.hf_dir={hf_dir}",
                                                                               "model.dtype=bfloat16"]), hf_dir)
            own = {n: t.clone() for n, t in bf16.bridge.export_hf_weights(bf16.model)}
            results["pp2/bf16"] = (own, {n: t.clone() for n, t in pipeline.pipeline_gathered(bf16.bridge, bf16.model)})
    return results


@pytest.mark.megatron  # builds a Megatron model
def test_token_budget_micro_batches_equal_padded(moe_then_dense_dir):
    run = run_on_ranks(run_phases, 2, None, moe_then_dense_dir)
    for rank, results in enumerate(run):
        for layout_name in PHASE_LAYOUTS:
            for algo_name in ALGOS:
                ref = results[f"{layout_name}/{algo_name}/padded"]
                # 8 rows, 2 minibatches, micro batches of 2 rows: 2 DP ranks one each, PP2 (DP 1) two each
                assert ref["plan"] == ([[2], [2]] if layout_name == "dp2" else [[2, 2], [2, 2]]), ref["plan"]
                assert ref["metrics"]["grad_norm"] > 0
                # padded rows compute their whole width: every row of the batch, over the DP ranks, once
                assert abs(ref["metrics"]["padding_frac"] - (1 - ref["tokens"] / (8 * ref["width"]))) < 1e-12, ref
                for name in PHASE_CASES:
                    key = f"{layout_name}/{algo_name}/{name}"
                    if name == "padded" or key not in results:
                        continue
                    got, where = results[key], f"rank {rank} {key}"
                    assert (got["old"] - ref["old"]).abs().max() <= LOGPROB_ATOL, where
                    # packed rows: no padding (DP2: rows of their own tokens; PP2: one length for all, the longest)
                    padding = got["metrics"]["padding_frac"]
                    assert padding == 0.0 if layout_name == "dp2" else 0 < padding < ref["metrics"]["padding_frac"], (
                        where, padding)
                    for metric, want in ref["metrics"].items():
                        if metric.startswith("time/") or metric == "padding_frac":
                            continue
                        assert abs(got["metrics"][metric] - want) <= RTOL * max(abs(want), 1.0), (
                            where, metric, got["metrics"][metric], want)
                    grads = tiny.max_rel_diff(got["grads"], ref["grads"])
                    assert grads <= GRAD_RTOL, (where, grads)
                assert "expert_volatility" in ref["metrics"] or algo_name == "grpo_replay"
            plan = results[f"{layout_name}/gspo/budget"]["plan"]
            assert plan != ref["plan"], plan  # the budget regrouped the rows: not the fixed split
        if rank == 0:
            names, expected = results["pp2/gathered"]
            assert names == expected, (set(expected) - set(names), set(names) - set(expected))
    # bf16 under PP2: rank 0 gathers every stage's tensors bit for bit, each in the dtype its stage exports it in
    (first_stage, gathered), (last_stage, _) = (r["pp2/bf16"] for r in run)
    assert {t.dtype for t in last_stage.values()} == {torch.bfloat16, torch.float32}  # what makes this a test
    assert set(gathered) == set(first_stage) | set(last_stage)
    for name, tensor in {**first_stage, **last_stage}.items():
        assert gathered[name].dtype == tensor.dtype and torch.equal(gathered[name], tensor), name
