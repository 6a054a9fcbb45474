"""The GSPO update step on the tiny GLM-4.5 and DeepSeek-V3 models equals world=1 under TP2 (+SP), EP2, PP2 (the dense
first layer on stage 0) and TP2 x EP2 (expert-TP 1).

The policy is built as the trainer builds it (``provider.build_gpt_model`` + the bridge, from the HF files). One step
of SGD (lr 1, no momentum history: the update is exactly -grad) on 8 sequences (split over data-parallel ranks, micro
batches of 2); the updated weights are exported through the bridge as full HF tensors, so every gradient is compared
in HF terms across layouts: loss (1e-6 absolute: GSPO's loss with zero-mean advantages is ~1e-4, a difference of
fp32 log-ratios of sequences whose log-probs are ~5), gradient norm (1e-5 relative), every updated tensor (2e-6 absolute
on weights of ~0.1-1 and steps of ~1e-2). The frozen expert bias is exported bit-identical to the file.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from tests.model import hf_tiny
from tests.model.conftest import hf_models  # noqa: F401  (the tiny HF models, session-scoped)

FAMILIES = ("glm4_moe", "deepseek_v3")
SEQUENCES, SEQ, MICRO = 8, 12, 2
RTOL, ATOL, LOSS_ATOL = 1e-5, 2e-6, 1e-6
LAYOUTS = {"tp2": Layout(tensor=2, sequence_parallel=True), "ep2": Layout(expert=2), "pp2": Layout(pipeline=2),
           "tp2_ep2": Layout(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True)}


def _rollout(vocab: int) -> dict:
    from gspo_megatron.algo import group_advantages

    g = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, vocab, (SEQUENCES, SEQ + 1), generator=g)
    prompt = torch.randint(2, 7, (SEQUENCES, 1), generator=g)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.arange(SEQ) + 1 >= prompt,
            "advantages": group_advantages(torch.rand(SEQUENCES, generator=g), 4)}


def _policy(hf_dir: str, layout: Layout):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.process_groups import ensure_model_parallel
    from gspo_megatron.model.provider import build_gpt_model
    from tests.megatron_tiny import wrap_ddp

    ensure_model_parallel(layout)
    spec = read_hf_config(hf_dir)
    bridge = Bridge(spec)
    model = build_gpt_model(spec, layout)
    bridge.load_hf_weights(model, hf_dir)
    ddp = wrap_ddp(model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0,
                                                       clip_grad=0.0), [ddp])
    return spec, bridge, model, ddp, optimizer


def step_case(hf_dir: str, layout: Layout, rollout: dict) -> dict:
    from megatron.core import parallel_state as ps

    from gspo_megatron.train.update.loss import AlgoConfig
    from gspo_megatron.train.update.schedules import update_step

    _, bridge, model, ddp, optimizer = _policy(hf_dir, layout)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = SEQUENCES // dp
    micro = [{k: v[i : i + MICRO] for k, v in rollout.items()} for i in range(rank * share, (rank + 1) * share, MICRO)]
    out = update_step(ddp, optimizer, micro, AlgoConfig())
    return {"loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]),
            "exported": {n: t.clone() for n, t in bridge.export_hf_weights(model)}}


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
    return results


def layouts(hf_dirs: dict, rollouts: dict) -> dict:
    results = {}
    for kind, layout in LAYOUTS.items():  # one group shape at a time, both families in each
        for family, hf_dir in hf_dirs.items():
            results[(family, kind)] = step_case(hf_dir, layout, rollouts[family])
    return results


@pytest.fixture(scope="module")
def results(hf_models):
    hf_dirs = {family: str(hf_models[family]) for family in FAMILIES}
    (world1,) = run_on_ranks(reference, 1, Layout(), hf_dirs, timeout=300)
    per_rank = run_on_ranks(layouts, 2, Layout(), hf_dirs, {f: r["rollout"] for f, r in world1.items()}, timeout=480)
    return world1, per_rank


@pytest.mark.megatron
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_update_step_equals_world1(family, kind, results, hf_models):
    from gspo_megatron.model.hf_files import SafetensorsDir

    world1, per_rank = results
    expected = world1[family]
    original = SafetensorsDir(hf_models[family])
    moved = max((expected["exported"][n] - original.read(n)).abs().max().item() for n in expected["exported"])
    assert moved > 1e-3, f"the reference step moved no weight by more than {moved:.1e}"
    exported = {}
    for rank, r in enumerate(per_rank):
        r = r[(family, kind)]
        assert abs(r["loss"] - expected["loss"]) <= LOSS_ATOL, (rank, r["loss"], expected["loss"])
        assert abs(r["grad_norm"] - expected["grad_norm"]) <= RTOL * expected["grad_norm"], (rank, r["grad_norm"])
        exported.update(r["exported"])
    assert set(exported) == set(expected["exported"])
    diffs = {n: (exported[n] - t).abs().max().item() for n, t in expected["exported"].items()}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= ATOL, f"{worst} differs by {diffs[worst]:.2e} from world=1 after the step"
    bias = [n for n in exported if n.endswith("e_score_correction_bias")]
    assert bias and all(hf_tiny.same_bits(exported[n], original.read(n)) for n in bias), "the frozen bias moved"
