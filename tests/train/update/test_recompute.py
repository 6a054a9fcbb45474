"""Activation recompute reaches megatron, drops saved activations, and changes nothing else.

The ``recompute`` config section becomes the TransformerConfig fields of the policy the loop builds
(``train.startup.policy.build_policy``, megatron's local spec on CPU) and megatron's modules act on it: core attention and
MoE layers run inside checkpoints, dense MLPs for ``mlp``, whole layers for full. What autograd keeps at the end
of the forward shrinks accordingly, and an update step with each setting gives the loss, gradient norm and every
gradient of the step without recompute, at world=1 and under TP=2 with sequence parallelism. Tolerance: 1e-6
relative (recompute re-runs the same fp32 ops on the same inputs; the difference is expected to be exactly 0).
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.train.startup.config import load_config
from gspo_megatron.train.update.recompute import transformer_config_fields

RTOL = 1e-6
SEQ = 96
BASE = ["data.task=reverse", "model.dtype=float32", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "algo.minibatches=2", "parallel.micro_batch_size=2", "parallel.distributed_optimizer=false"]
CASES = [
    ("none", []),  # the default
    ("core_attn", ["recompute.granularity=selective"]),  # modules' default: [core_attn]
    ("moe", ["recompute.granularity=selective", "recompute.modules=[moe]"]),
    ("all_selective", ["recompute.granularity=selective", "recompute.modules=[core_attn,moe,mlp]"]),
    ("full_uniform", ["recompute.granularity=full"]),
    ("full_block", ["recompute.granularity=full", "recompute.method=block"]),
]


def run_cases(hf_dir: str, layout_overrides: list[str]) -> dict:
    """Each recompute setting on this rank: what reached the model, saved bytes after the forward, the step."""
    from gspo_megatron.model.hidden_output import unwrap
    from gspo_megatron.train.update import passes
    from gspo_megatron.train.update.rows import micro_batches, row_plan
    from gspo_megatron.train.startup.bootstrap import loss_config
    from gspo_megatron.plan.probe import peak_memory, synthetic_rollout
    from gspo_megatron.train.startup.policy import build_policy
    from gspo_megatron.train.update.schedules import update_step

    results = {}
    for name, overrides in CASES:
        cfg = load_config(None, BASE + layout_overrides + overrides + [f"model.hf_dir={hf_dir}"])
        algo = loss_config(cfg)
        batch = synthetic_rollout(cfg, 128, SEQ)
        policy = build_policy(cfg, hf_dir)
        gpt = unwrap(policy.model)
        layers = list(gpt.decoder.layers)
        reached = {
            "fields": {k: getattr(gpt.config, k) for k in
                       ("recompute_granularity", "recompute_modules", "recompute_method", "recompute_num_layers")},
            "core_attn": [layer.self_attention.checkpoint_core_attention for layer in layers],
            "moe": [bool(getattr(layer.mlp, "moe_layer_recompute", False)) for layer in layers],
            "mlp": [layer.recompute_mlp for layer in layers],
        }
        rows = row_plan(batch["input_ids"].shape[0], cfg)
        passes.old_logprobs(policy, batch, rows, cfg, algo, {})
        saved = []
        with peak_memory() as mem:
            start = mem.current
            hook = gpt.register_forward_hook(lambda *_: saved.append(mem.current - start))
            out = update_step(policy.model, policy.optimizer, micro_batches(batch, rows[0], cfg), algo)
            hook.remove()
        grads = torch.cat([p.main_grad.detach().flatten().clone() for p in policy.model.parameters()])
        results[name] = {"reached": reached, "saved": saved[0], "loss": float(out["loss"]),
                         "grad_norm": out["grad_norm"], "grads": grads}
    return results


def _check(per_rank: list[dict]) -> None:
    for rank, results in enumerate(per_rank):
        ref = results["none"]
        assert ref["grads"].abs().max() > 0 and ref["grad_norm"] > 0, rank
        for name, got in results.items():
            where = f"rank {rank} {name}"
            assert abs(got["loss"] - ref["loss"]) <= RTOL * abs(ref["loss"]), where
            assert abs(got["grad_norm"] - ref["grad_norm"]) <= RTOL * ref["grad_norm"], where
            diff = ((got["grads"] - ref["grads"]).abs().max() / ref["grads"].abs().max()).item()
            assert diff <= RTOL, f"{where}: grads rel diff {diff:.2e}"
        reached = {name: r["reached"] for name, r in results.items()}
        assert reached["none"]["fields"]["recompute_granularity"] is None
        assert reached["none"]["core_attn"] == [False, False] and reached["none"]["moe"] == [False, False]
        assert reached["core_attn"]["fields"]["recompute_modules"] == ["core_attn"]
        assert reached["core_attn"]["core_attn"] == [True, True] and reached["core_attn"]["moe"] == [False, False]
        assert reached["moe"]["moe"] == [True, False] and reached["moe"]["core_attn"] == [False, False]
        assert reached["all_selective"]["mlp"] == [False, True]  # the dense MLP of layer 1
        assert reached["full_uniform"]["fields"] == {"recompute_granularity": "full", "recompute_modules": ["core_attn"],
                                                     "recompute_method": "uniform", "recompute_num_layers": 1}
        assert reached["full_block"]["fields"]["recompute_method"] == "block"
        # Each setting keeps less at the end of the forward than the one before it.
        saved = {name: r["saved"] for name, r in results.items()}
        assert saved["none"] > saved["core_attn"] > saved["all_selective"] > saved["full_uniform"], saved
        assert saved["none"] > saved["moe"] > saved["all_selective"], saved
        assert saved["none"] > saved["full_block"] > saved["full_uniform"], saved


def test_recompute_fields():
    assert transformer_config_fields(load_config(None)) == {}  # megatron's default: no recompute
    assert transformer_config_fields(load_config(None, ["recompute.granularity=selective"])) == {
        "recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    assert transformer_config_fields(load_config(None, ["recompute.granularity=full", "recompute.method=block",
                                                        "recompute.num_layers=2"])) == {
        "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}


@pytest.mark.megatron  # builds a Megatron model
def test_recompute_equals_no_recompute_world1(moe_then_dense_dir):
    _check(run_on_ranks(run_cases, 1, Layout(), moe_then_dense_dir, []))


@pytest.mark.megatron  # builds a Megatron model
def test_recompute_equals_no_recompute_tp2(moe_then_dense_dir):
    layout = Layout(tensor=2, sequence_parallel=True)
    _check(run_on_ranks(run_cases, 2, layout, moe_then_dense_dir, ["parallel.tensor=2"]))


@pytest.mark.parametrize("grouped_gemm, te, refused", [
    ("true", True, None),  # TEGroupedMLP: megatron recomputes the activation
    ("null", True, None),  # grouped wherever TE imports
    ("false", True, "model.grouped_gemm=false"),  # SequentialMLP: megatron refuses moe_act
    ("null", False, "model.grouped_gemm=null and TransformerEngine does not import"),
])
def test_moe_act_is_refused_exactly_where_megatron_refuses_it(grouped_gemm, te, refused):
    from gspo_megatron.train.startup.config import ConfigError
    from gspo_megatron.train.update.recompute import check_recompute

    cfg = load_config(None, ["recompute.granularity=selective", "recompute.modules=[core_attn,moe_act]",
                             f"model.grouped_gemm={grouped_gemm}"])
    if refused is None:
        check_recompute(cfg, transformer_engine=te)
        assert transformer_config_fields(cfg)["recompute_modules"] == ["core_attn", "moe_act"]
    else:
        with pytest.raises(ConfigError, match=rf"recompute.modules: 'moe_act' needs grouped-GEMM .*{refused}"):
            check_recompute(cfg, transformer_engine=te)


@pytest.mark.megatron
def test_megatron_accepts_moe_act_with_grouped_experts_and_refuses_it_without():
    # The rule above is megatron's own (TransformerConfig.__post_init__, 0.16.1 and 0.19.2).
    from megatron.core.transformer import TransformerConfig

    common = dict(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=2, moe_router_topk=2,
                  recompute_granularity="selective", recompute_modules=["moe_act"])
    TransformerConfig(**common, moe_grouped_gemm=True)
    with pytest.raises(ValueError, match="moe_act in recompute_modules is only supported with moe_grouped_gemm"):
        TransformerConfig(**common, moe_grouped_gemm=False)
