"""The GSPO update step on the tiny GLM-4.5, DeepSeek-V3, gpt-oss and MiniMax-M2 models equals world=1 under TP2 (+SP; gpt-oss:
expert-TP 1), EP2, PP2 (the dense first layer on stage 0) and TP2 x EP2 (expert-TP 1); on the three-layer Moonlight
under uneven PP2 (its dense first layer alone on stage 0, two MoE layers on stage 1: ``parallel.first_stage_layers``);
on the gated-DeltaNet hybrids Qwen3.5-MoE and Qwen3-Next (``hf_tiny.HYBRID_VARIANTS``: TP2 splits the DeltaNet's key
and value heads, PP2 puts two DeltaNet layers on stage 0, a DeltaNet and the gated attention layer on stage 1) under
the same four layouts, to looser bounds (``HYBRID_*``: their tiny random models are badly conditioned, grad norms of
44-170). gpt-oss's biased experts need expert-TP 1: its TP2 holds every expert whole on each TP rank, which routes its
own sequence shard through them, so their gradients are summed over the expert-data-parallel group (the two TP ranks;
megatron-core 0.16.1 reduced them as dense ones over the one-rank data-parallel group: up to 4e-2 off world 1 after
the step, the ranks' experts diverging, before ``provider.reduce_experts_over_expert_data_parallel``).

The policy is built as the trainer builds it (``provider.build_gpt_model`` + the bridge, from the HF files). One step
of SGD (lr 1, no momentum history: the update is exactly -grad) on 8 sequences (split over data-parallel ranks, micro
batches of 2); the updated weights are exported through the bridge as full HF tensors, so every gradient is compared
in HF terms across layouts: loss (1e-6 absolute: GSPO's loss with zero-mean advantages is ~1e-4, a difference of
fp32 log-ratios of sequences whose log-probs are ~5), gradient norm (1e-5 relative), every updated tensor (2e-6 absolute
on weights of ~0.1-1 and steps of ~1e-2). The frozen expert bias is exported bit-identical to the file.

GRPO + Routing Replay, at world=1, TP2 (+SP), PP2 and TP2 x EP2: an old policy whose routers' weights and expert biases
(gpt-oss: its router's own bias) drifted (seeded per layer, so alike under every layout) records its experts; the update replays them. Hooks on every
router show it used exactly the recorded experts for every token (the drift changed over 20% of them, so free routing
would not), and the step equals world=1's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from tests.model import hf_tiny, rank_checks
from tests.model.conftest import hf_models, hybrid_models  # noqa: F401  (the tiny HF models, session-scoped)

FAMILIES = ("glm4_moe", "deepseek_v3", "gpt_oss", "minimax_m2")
HYBRIDS = ("qwen3_5_moe", "qwen3_next")  # softmax routers without expert bias, a gated shared expert
UNEVEN = "moonlight"  # three layers: PP2 only as uneven stages (its dense first layer alone on stage 0)
SEQUENCES, SEQ, MICRO = 8, 12, 2
RTOL, ATOL, LOSS_ATOL = 1e-5, 2e-6, 1e-6
# The tiny random hybrids are badly conditioned: grad norms of 44 (Qwen3.5-MoE) and 170 (Qwen3-Next; GLM's ~1), steps
# of 1-28 at lr 1. fp32 rounding of the TP-split in_proj / out_proj sums then moves their log-probs under TP2 by up to
# 8e-5 per token (median 1.4e-6), GSPO's ~1e-4 loss by 2.4e-6, the grad norm by 9e-5 of itself and each tensor by up
# to 2.2e-4 of its own step (all measured, Qwen3-Next at TP2). Their bounds: loss 1e-5, grad norm 3e-4 relative, each
# tensor 5e-4 of its step (a wrong split or reduction is off by O(1) of the step).
HYBRID_LOSS_ATOL, HYBRID_RTOL, HYBRID_STEP_RTOL = 1e-5, 3e-4, 5e-4
RR_LAYOUTS = ("tp2", "pp2", "tp2_ep2")  # GRPO + Routing Replay: sequence shards, a dense first stage, both
LAYOUTS = {"tp2": Layout(tensor=2, sequence_parallel=True), "ep2": Layout(expert=2), "pp2": Layout(pipeline=2),
           "tp2_ep2": Layout(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True)}
EXPERT_TP1 = {"gpt_oss"}  # biased experts, which megatron-core splits only under expert-TP 1: set in every layout


def _rollout(vocab: int) -> dict:
    from gspo_megatron.algo import group_advantages

    g = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, vocab, (SEQUENCES, SEQ + 1), generator=g)
    prompt = torch.randint(2, 7, (SEQUENCES, 1), generator=g)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.arange(SEQ) + 1 >= prompt,
            "advantages": group_advantages(torch.rand(SEQUENCES, generator=g), 4)}


def _policy(hf_dir: str, layout: Layout, routing_replay: bool = False):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.process_groups import ensure_model_parallel
    from gspo_megatron.model.provider import build_gpt_model
    from tests.megatron_tiny import wrap_ddp

    ensure_model_parallel(layout)
    if routing_replay:  # megatron keeps every replaying router in one global registry: this model's only
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()
    spec = read_hf_config(hf_dir)
    bridge = Bridge(spec)
    model = build_gpt_model(spec, layout, **({"moe_enable_routing_replay": True} if routing_replay else {}))
    bridge.load_hf_weights(model, hf_dir)
    ddp = wrap_ddp(model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0,
                                                       clip_grad=0.0), [ddp])
    return spec, bridge, model, ddp, optimizer


def _routers(ddp) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return sorted((m for m in ddp.modules() if isinstance(m, TopKRouter)), key=lambda r: r.layer_number)


def _router_bias(router) -> torch.Tensor:
    """The bias added to the router's choice: the expert bias (sigmoid routers), its linear's bias (gpt-oss), or an
    empty stand-in (the hybrids' softmax routers have none)."""
    for bias in (router.expert_bias, getattr(router, "bias", None)):
        if bias is not None:
            return bias
    return torch.zeros(0)


def _drifted_routing(ddp, micro: list[dict]) -> torch.Tensor:
    """The experts this rank's routers choose after a drift of every router's weight and expert bias, seeded by its
    layer number (the same drift under every layout), recorded by the log-prob pass, then undone: an old policy
    that routes otherwise. [n, L_local, s_local, k]."""
    from gspo_megatron.train.update.schedules import logprob_pass

    saved = []
    with torch.no_grad():
        for router in _routers(ddp):
            g = torch.Generator().manual_seed(router.layer_number)
            bias = _router_bias(router)
            saved.append((router.weight.detach().clone(), bias.detach().clone()))
            router.weight.add_(0.5 * torch.randn(router.weight.shape, generator=g))
            bias.add_(0.5 * torch.randn(bias.shape, generator=g))
    routing = logprob_pass(ddp, micro, record_old_routing=True)["old_routing"]
    with torch.no_grad():
        for router, (weight, bias) in zip(_routers(ddp), saved):
            router.weight.copy_(weight)
            _router_bias(router).copy_(bias)
    return routing


def step_case(hf_dir: str, layout: Layout, rollout: dict, algo: str = "gspo") -> dict:
    """One update step of ``algo``: gspo, or grpo_rr (GRPO + Routing Replay: the update replays the routes an old,
    drifted policy recorded; every router's choices in the update are compared with them)."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.train.update.loss import LossConfig
    from gspo_megatron.train.update.schedules import update_step

    _, bridge, model, ddp, optimizer = _policy(hf_dir, layout, routing_replay=algo == "grpo_rr")
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = SEQUENCES // dp
    micro = [{k: v[i : i + MICRO] for k, v in rollout.items()} for i in range(rank * share, (rank + 1) * share, MICRO)]
    result = {}
    if algo == "grpo_rr":
        from gspo_megatron.train.update.schedules import logprob_pass

        routing = _drifted_routing(ddp, micro)
        # what the routers choose without replay
        free = logprob_pass(ddp, micro, record_old_routing=True)["old_routing"]
        result["changed"] = (routing.sort(dim=-1).values != free.sort(dim=-1).values).any(dim=-1).float().mean().item()
        for i, mb in enumerate(micro):
            mb["old_routing"] = routing[i * MICRO:(i + 1) * MICRO]
        used: list = []  # (layer, routing map [s_local * b, E]) of every router call of the update

        def hook(router):
            return lambda _m, _i, output: used.append((router.layer_number, output[1].detach().clone()))

        handles = [r.register_forward_hook(hook(r)) for r in _routers(ddp)]
        out = update_step(ddp, optimizer, micro, LossConfig.grpo(), replay_old_routing=True)
        for h in handles:
            h.remove()
        result["routes_same"], result["routes_total"] = _replayed(used, routing, _routers(ddp))
    else:
        out = update_step(ddp, optimizer, micro, LossConfig())
    return {**result, "loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]),
            "exported": {n: t.clone() for n, t in bridge.export_hf_weights(model)}}


def _replayed(used: list, routing: torch.Tensor, routers: list) -> tuple[int, int]:
    """(tokens x layers whose experts in the update were the recorded ones, out of how many): the router calls come
    micro batch by micro batch, each layer in order; ``routing`` [n, L_local, s_local, k] holds them in that order."""
    layers = [r.layer_number for r in routers]
    same = total = 0
    for call, (layer, routing_map) in enumerate(used):
        micro, local = divmod(call, len(layers))
        assert layers[local] == layer, (call, layer, layers)
        recorded = routing[micro * MICRO:(micro + 1) * MICRO, local].long()  # [b, s_local, k]
        b, s_local, _ = recorded.shape
        hot = torch.zeros(b, s_local, routing_map.shape[-1], dtype=torch.bool).scatter_(2, recorded, True)
        chosen = routing_map.view(s_local, b, -1).transpose(0, 1)
        same += int((chosen == hot).all(dim=-1).sum())
        total += b * s_local
    return same, total


def reference(hf_dirs: dict) -> dict:
    """world=1: the rollout (old log-probs from the loaded model, perturbed by 1e-3) and the step."""
    from gspo_megatron.train.update.schedules import logprob_pass

    results = {}
    for family, hf_dir in hf_dirs.items():
        spec, _, _, ddp, _ = _policy(hf_dir, Layout())
        rollout = _rollout(spec.vocab_size)
        micro = [{k: v[i : i + MICRO] for k, v in rollout.items()} for i in range(0, SEQUENCES, MICRO)]
        logprobs = logprob_pass(ddp, micro)["logprobs"]
        noise = 1e-3 * torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(3))
        rollout["old_logprobs"] = logprobs + noise
        results[family] = {"rollout": rollout, **step_case(hf_dir, Layout(), rollout)}
        if family != UNEVEN:
            results[family]["grpo_rr"] = step_case(hf_dir, Layout(), rollout, "grpo_rr")
    return results


def layouts(hf_dirs: dict, rollouts: dict) -> dict:
    results = {}
    for kind, layout in LAYOUTS.items():  # one group shape at a time, every family in each
        for family, hf_dir in hf_dirs.items():
            if family == UNEVEN and kind != "pp2":
                continue
            here = rank_checks.pp2_layout(hf_dir) if kind == "pp2" else layout  # pp2: even for 2 layers, 1 + 2 for 3
            if family in EXPERT_TP1:
                here = dataclasses.replace(here, expert_tensor=1)
            results[(family, kind)] = step_case(hf_dir, here, rollouts[family])
            if kind in RR_LAYOUTS and family != UNEVEN:
                results[(family, kind, "grpo_rr")] = step_case(hf_dir, here, rollouts[family], "grpo_rr")
    return results


@pytest.fixture(scope="module")
def results(hf_models, hybrid_models):
    hf_dirs = {family: str(hf_models[family]) for family in (*FAMILIES, UNEVEN)}
    hf_dirs.update({family: str(hybrid_models[family]) for family in HYBRIDS})
    (world1,) = run_on_ranks(reference, 1, Layout(), hf_dirs, timeout=300)
    per_rank = run_on_ranks(layouts, 2, Layout(), hf_dirs, {f: r["rollout"] for f, r in world1.items()}, timeout=480)
    return world1, per_rank


def _assert_same_loss(family: str, r: dict, expected: dict, rank: int) -> None:
    loss_atol, rtol = (HYBRID_LOSS_ATOL, HYBRID_RTOL) if family in HYBRIDS else (LOSS_ATOL, RTOL)
    assert abs(r["loss"] - expected["loss"]) <= loss_atol, (rank, r["loss"], expected["loss"])
    assert abs(r["grad_norm"] - expected["grad_norm"]) <= rtol * expected["grad_norm"], (rank, r["grad_norm"])


def _assert_same_weights(exported: dict, expected: dict, original, step_rtol: float) -> None:
    """Every updated tensor as world=1's: within ATOL, or ``step_rtol`` of the tensor's own step where larger."""
    assert set(exported) == set(expected)
    worst, name = 0.0, None
    for n, t in expected.items():
        bound = max(ATOL, step_rtol * (t - original.read(n)).abs().max().item())
        ratio = (exported[n] - t).abs().max().item() / bound
        if ratio > worst:
            worst, name = ratio, n
    assert worst <= 1.0, f"{name} differs from world=1 after the step by {worst:.2f}x its bound"


@pytest.mark.megatron
@pytest.mark.parametrize("family, kind", [(f, k) for k in LAYOUTS for f in FAMILIES + HYBRIDS] + [(UNEVEN, "pp2")])
def test_update_step_equals_world1(family, kind, results, hf_models, hybrid_models):
    from gspo_megatron.model.hf_files import SafetensorsDir

    world1, per_rank = results
    expected = world1[family]
    original = SafetensorsDir({**hf_models, **hybrid_models}[family])
    moved = max((expected["exported"][n] - original.read(n)).abs().max().item() for n in expected["exported"])
    assert moved > 1e-3, f"the reference step moved no weight by more than {moved:.1e}"
    exported = {}
    for rank, r in enumerate(per_rank):
        r = r[(family, kind)]
        _assert_same_loss(family, r, expected, rank)
        exported.update(r["exported"])
    assert set(exported) == set(expected["exported"])
    _assert_same_weights(exported, expected["exported"], original, HYBRID_STEP_RTOL if family in HYBRIDS else 0.0)
    bias = [n for n in exported if n.endswith("e_score_correction_bias")]
    assert bool(bias) == (family not in HYBRIDS and family != "gpt_oss"), bias
    assert all(hf_tiny.same_bits(exported[n], original.read(n)) for n in bias), "the frozen bias moved"


@pytest.mark.megatron
@pytest.mark.parametrize("family, kind", [(f, k) for k in ("world1", *RR_LAYOUTS) for f in FAMILIES + HYBRIDS])
def test_grpo_routing_replay_replays_every_route_and_equals_world1(family, kind, results, hf_models, hybrid_models):
    """GRPO + Routing Replay with the sigmoid, bias-corrected, group-limited routers, gpt-oss's biased softmax ones and
    the hybrids' softmax ones (a DeltaNet or gated attention layer before each): in the update, every router
    uses exactly the experts the drifted old policy recorded, for every token (the drift changed them: the update
    would otherwise route differently), and the step equals world=1's under each layout."""
    from gspo_megatron.model.hf_files import SafetensorsDir

    world1, per_rank = results
    expected = world1[family]["grpo_rr"]
    original = SafetensorsDir({**hf_models, **hybrid_models}[family])
    runs = [expected] if kind == "world1" else [r[(family, kind, "grpo_rr")] for r in per_rank]
    assert sum(r["routes_total"] for r in runs) > 0
    for rank, r in enumerate(runs):
        if r["routes_total"] == 0:  # PP2's first stage: the dense first layer alone, no router
            continue
        assert r["routes_same"] == r["routes_total"], (rank, r["routes_same"], r["routes_total"])
        assert r["changed"] > 0.2, f"rank {rank}: the drift changed only {r['changed']:.0%} of the routes"
    if kind == "world1":
        return
    exported = {}
    for rank, r in enumerate(runs):
        _assert_same_loss(family, r, expected, rank)
        exported.update(r["exported"])
    _assert_same_weights(exported, expected["exported"], original, HYBRID_STEP_RTOL if family in HYBRIDS else 0.0)
