"""The sigmoid router's expert bias in RL (``provider.freeze_expert_bias``): frozen by default, updated on request,
exported either way. One launch of 2 data-parallel gloo ranks (different data per rank) on the tiny GLM-4.5 model:
a GSPO update step (Adam, lr 1e-2) with the bias frozen leaves it bit-identical on every rank while the other
weights (the router's included) move; with ``update_expert_bias=True`` megatron moves each element by exactly
``moe_router_bias_update_rate`` (1e-3) or 0, the same on both ranks (load counts all-reduced). The bridge's export
(conversion, weight sync) yields the bias the trainer routes with, bit for bit, in both cases, in fp32 when the
export is cast to bf16 (the engine keeps it fp32: ``mapping.KEPT_FP32``).
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from tests.model import hf_tiny

BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
ROUTER = "decoder.layers.1.mlp.router"
SEQUENCES, SEQ, GROUP = 4, 12, 4


def _rollout(vocab: int, rank: int) -> dict:
    from gspo_megatron.algo import group_advantages

    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, vocab, (SEQUENCES, SEQ + 1), generator=g)
    prompt = torch.randint(2, 6, (SEQUENCES, 1), generator=g)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
            "loss_mask": torch.arange(SEQ).unsqueeze(0) + 1 >= prompt,
            "advantages": group_advantages(torch.rand(SEQUENCES, generator=g), GROUP)}


def bias_steps(hf_dir: str) -> dict:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.hf_files import SafetensorsDir
    from gspo_megatron.model.provider import build_gpt_model
    from gspo_megatron.train.update.loss import LossConfig
    from gspo_megatron.train.update.schedules import logprob_pass, update_step
    from tests.megatron_tiny import wrap_ddp

    spec = read_hf_config(hf_dir)
    bridge, files = Bridge(spec), SafetensorsDir(hf_dir)
    rollout = _rollout(spec.vocab_size, torch.distributed.get_rank())
    results = {}
    for update in (False, True):
        model = build_gpt_model(spec, Layout(), update_expert_bias=update)
        bridge.load_hf_weights(model, hf_dir)
        ddp = wrap_ddp(model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.0,
                                                           clip_grad=0.0), [ddp])
        micro = [{k: v[i : i + 2] for k, v in rollout.items()} for i in (0, 2)]
        old = logprob_pass(ddp, micro)["logprobs"]
        micro = [{**m, "old_logprobs": old[i : i + 2]} for m, i in zip(micro, (0, 2))]
        router = model.get_submodule(ROUTER)
        bias_before = router.expert_bias.detach().clone()
        weight_before = router.weight.detach().clone()
        out = update_step(ddp, optimizer, micro, LossConfig())
        exported = dict(bridge.export_hf_weights(model))
        bf16 = dict(bridge.export_hf_weights(model, dtype=torch.bfloat16))  # a bf16 engine's sync or export
        sender = dict(bridge.export_to_sender(model, dtype=torch.bfloat16))  # rank 0's: the distributed sync's
        results[update] = {
            "loss": float(out["loss"]),
            "bias_before": bias_before, "bias_after": router.expert_bias.detach().clone(),
            "router_moved": (router.weight.detach() - weight_before).abs().max().item(),
            "file_bias": files.read(BIAS), "exported_bias": exported[BIAS].clone(),
            "bf16_bias": [bf16[BIAS].clone()] + ([sender[BIAS].clone()] if sender else []),
            "bf16_others": {t.dtype for export in (bf16, sender) for n, t in export.items() if n != BIAS},
            "rate": model.config.moe_router_bias_update_rate,
        }
    return results


@pytest.fixture(scope="module")
def per_rank(hf_models):
    return run_on_ranks(bias_steps, 2, Layout(), str(hf_models["glm4_moe"]), timeout=300)


@pytest.mark.megatron
def test_a_frozen_expert_bias_stays_bit_identical_through_an_update(per_rank):
    for rank, results in enumerate(per_rank):
        r = results[False]
        assert torch.isfinite(torch.tensor(r["loss"])), rank
        assert r["router_moved"] > 1e-4, f"rank {rank}: the step did not move the router ({r['router_moved']:.1e})"
        assert hf_tiny.same_bits(r["bias_before"], r["file_bias"]), f"rank {rank}: the bias did not load"
        assert hf_tiny.same_bits(r["bias_after"], r["bias_before"]), f"rank {rank}: the frozen bias changed"
        assert hf_tiny.same_bits(r["exported_bias"], r["file_bias"]), f"rank {rank}: export lost the bias"


@pytest.mark.megatron
def test_update_expert_bias_moves_it_by_the_rate_and_exports_the_moved_bias(per_rank):
    for rank, results in enumerate(per_rank):
        r = results[True]
        step = (r["bias_after"] - r["bias_before"]).abs()
        assert (step > 0).any(), f"rank {rank}: update_expert_bias=True left the bias unchanged"
        on_rate = (step - r["rate"]).abs() <= 1e-7  # fp32: bias ~0.1, rate 1e-3
        assert (on_rate | (step == 0)).all(), f"rank {rank}: bias steps {step.tolist()} are not 0 or {r['rate']}"
        assert hf_tiny.same_bits(r["exported_bias"], r["bias_after"]), f"rank {rank}: export is not the moved bias"
        # Cast to bf16 (the engine's dtype), the bias stays the trainer's fp32 one (mapping.KEPT_FP32): rounded,
        # the moved bias would be lost (its steps are far below a bf16 step at ~0.1) and routing would differ.
        assert not torch.equal(r["bias_after"].bfloat16().float(), r["bias_after"])
        assert len(r["bf16_bias"]) == (2 if rank == 0 else 1) and r["bf16_others"] == {torch.bfloat16}, rank
        assert all(hf_tiny.same_bits(b, r["bias_after"]) for b in r["bf16_bias"]), f"rank {rank}: bf16 export"
    assert hf_tiny.same_bits(per_rank[0][True]["bias_after"], per_rank[1][True]["bias_after"]), "ranks disagree"
