"""Megatron's speed settings reach megatron, and change no update step.

The ``performance`` config section becomes TransformerConfig and DDP fields of the policy the loop builds
(``train.startup.policy.build_policy``). On 2 gloo ranks with EP=2 (so dense parameters are data-parallel over both ranks
and experts expert-parallel), each setting that runs on a CPU does two update steps on the same rollout, and the
loss and gradient norm of each step and every parameter after both steps equal the default's:

- the router in fp32 (the default), in the model's dtype (none) and in fp64, and the allgather token dispatcher
  instead of alltoall: identical (fp32 model: the same ops, tokens visit experts in another order) within 1e-6
  relative, fp64 routing within 1e-5 (the router's logits round differently);
- the bias/SwiGLU and residual fusions (torch.compile'd on CPU too): within 1e-6;
- DDP's overlapped gradient reduction, and the distributed optimizer's overlapped parameter all-gather (against
  the distributed optimizer without it): within 1e-6. With the overlapped all-gather the parameters after a step
  are stale until the next forward or ``performance.params_current`` (checked: weight sync and checkpoints call it);
- bf16 gradient buffers (``optimizer.grad_reduce_in_fp32=false``: megatron's main_grad in bf16) against fp32 ones, in
  bf16 training with the distributed optimizer: the first step's loss identical, gradient norms and the parameters
  after both steps within 1e-2 relative (micro batches accumulate and ranks reduce in bf16).

The TE/CUDA/apex-only options cannot run here: they are checked to reach megatron's config on a machine that has
them in the GPU check; here a ``true`` is a named ConfigError and ``null`` resolves to off.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.train.startup import performance
from gspo_megatron.train.startup.config import ConfigError, load_config
from gspo_megatron.train.startup.validate import validate

RTOL = 1e-6
RTOL_FP64_ROUTER = 1e-5
SEQ = 48
BASE = ["data.task=reverse", "model.dtype=float32", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "algo.minibatches=2", "parallel.micro_batch_size=2", "parallel.expert=2",
        "parallel.distributed_optimizer=false", "algo.eps_low=0.2", "algo.eps_high=0.2"]
BF16 = ["model.dtype=bfloat16", "parallel.distributed_optimizer=true", "optimizer.lr=1.0", "optimizer.adam_eps=1.0"]
RTOL_BF16_GRADS = 1e-2
# (name, overrides, the case it must equal)
CASES = [
    ("default", [], None),
    ("router_none", ["performance.moe_router_dtype=none"], "default"),
    ("router_fp64", ["performance.moe_router_dtype=fp64"], "default"),
    ("allgather", ["performance.moe_token_dispatcher=allgather"], "default"),
    ("fusions", ["performance.bias_activation_fusion=true", "performance.bias_dropout_fusion=true"], "default"),
    ("overlap_grad", ["performance.overlap_grad_reduce=true"], "default"),
    ("distopt", ["parallel.distributed_optimizer=true"], None),
    ("distopt_overlap", ["parallel.distributed_optimizer=true", "performance.overlap_grad_reduce=true",
                         "performance.overlap_param_gather=true"], "distopt"),
    # bf16 with DDP's gradient buffer in fp32 and in bf16 (Adam with eps 1: a step continuous in the gradient, and
    # large enough for bf16 weights to show it)
    ("bf16", BF16, None),
    ("bf16_grads", BF16 + ["optimizer.grad_reduce_in_fp32=false"], "bf16"),
]


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def run_cases(hf_dir: str) -> dict:
    """Each setting on this rank: what reached megatron, two update steps, the parameters after them."""
    from gspo_megatron.model.hidden_output import unwrap
    from gspo_megatron.train.update.rows import micro_batches, row_plan
    from gspo_megatron.train.startup.bootstrap import loss_config
    from gspo_megatron.plan.probe import synthetic_rollout
    from gspo_megatron.train.startup.policy import build_policy
    from gspo_megatron.train.update.schedules import update_step

    results = {}
    for name, overrides, _ in CASES:
        cfg = load_config(None, BASE + overrides + [f"model.hf_dir={hf_dir}"])
        algo = loss_config(cfg)
        batch = synthetic_rollout(cfg, 128, SEQ)
        policy = build_policy(cfg, hf_dir)
        gpt = unwrap(policy.model)
        reached = {k: getattr(gpt.config, k) for k in
                   ("moe_token_dispatcher_type", "moe_router_dtype", "moe_permute_fusion", "apply_rope_fusion",
                    "gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion")}
        ddp = policy.model.ddp_config
        reached.update(overlap_grad_reduce=ddp.overlap_grad_reduce, overlap_param_gather=ddp.overlap_param_gather,
                       no_sync_func=gpt.config.no_sync_func is not None,
                       dispatcher=type(gpt.decoder.layers[0].mlp.token_dispatcher).__name__,
                       grad_dtype=next(p.main_grad.dtype for p in gpt.parameters() if hasattr(p, "main_grad")))
        rows = row_plan(batch["input_ids"].shape[0], cfg)
        batch["old_logprobs"] = batch["rollout_logprobs"]
        start = _params(policy.model)
        steps = []
        for minibatch in rows:
            out = update_step(policy.model, policy.optimizer, micro_batches(batch, minibatch, cfg), algo)
            steps.append((float(out["loss"]), out["grad_norm"], bool(out["update_successful"])))
        before = _params(policy.model)
        performance.params_current(policy.model)
        current = _params(policy.model)
        results[name] = {"reached": reached, "steps": steps, "params": current,
                         "moved": bool((current != start).any()), "was_stale": bool((before != current).any())}
    return results


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.megatron  # builds a Megatron model
def test_settings_reach_megatron_and_leave_the_step_unchanged(moe_then_dense_dir):
    per_rank = run_on_ranks(run_cases, 2, Layout(expert=2), moe_then_dense_dir)
    for rank, results in enumerate(per_rank):
        for name, _, reference in CASES:
            got = results[name]
            where = f"rank {rank} {name}"
            assert all(ok for *_, ok in got["steps"]), where
            if reference is None:
                assert got["steps"][0][1] > 0, where
                continue
            ref = results[reference]
            tol = {"router_fp64": RTOL_FP64_ROUTER, "bf16_grads": RTOL_BF16_GRADS}.get(name, RTOL)
            for (loss, norm, _), (ref_loss, ref_norm, _) in zip(got["steps"], ref["steps"]):
                assert abs(loss - ref_loss) <= tol * abs(ref_loss), (where, loss, ref_loss)
                assert abs(norm - ref_norm) <= tol * ref_norm, (where, norm, ref_norm)
            diff = _rel(got["params"], ref["params"])
            assert diff <= tol, f"{where}: parameters differ by {diff:.2e} (rel)"
        reached = {name: r["reached"] for name, r in results.items()}
        default = reached["default"]
        assert default["moe_token_dispatcher_type"] == "alltoall"
        assert default["dispatcher"] == "MoEAlltoAllTokenDispatcher"
        assert default["moe_router_dtype"] == "fp32"
        # On a CPU without TE / apex every machine-dependent option resolves to off.
        assert not any(default[k] for k in ("moe_permute_fusion", "apply_rope_fusion", "gradient_accumulation_fusion",
                                             "bias_activation_fusion", "bias_dropout_fusion"))
        assert not default["overlap_grad_reduce"] and not default["no_sync_func"]
        assert reached["router_none"]["moe_router_dtype"] is None
        assert reached["router_fp64"]["moe_router_dtype"] == "fp64"
        assert reached["allgather"]["dispatcher"] == "MoEAllGatherTokenDispatcher"
        assert reached["fusions"]["bias_activation_fusion"] and reached["fusions"]["bias_dropout_fusion"]
        assert reached["overlap_grad"]["overlap_grad_reduce"] and reached["overlap_grad"]["no_sync_func"]
        assert reached["distopt_overlap"]["overlap_param_gather"]
        assert default["grad_dtype"] == reached["bf16"]["grad_dtype"] == torch.float32
        assert reached["bf16_grads"]["grad_dtype"] == torch.bfloat16  # optimizer.grad_reduce_in_fp32=false
        assert results["bf16_grads"]["steps"][0][0] == results["bf16"]["steps"][0][0]  # the same first forward
        # The steps moved the weights; with the overlapped all-gather the last step's were stale until gathered.
        assert _rel(results["default"]["params"], results["distopt"]["params"]) <= RTOL
        assert all(r["moved"] for r in results.values())
        assert [name for name, r in results.items() if r["was_stale"]] == ["distopt_overlap"]


def _cfg(*overrides):
    return load_config(None, ["data.task=count", *overrides])


def test_fields_and_defaults():
    fields = performance.transformer_config_fields(_cfg())
    assert fields == {"moe_token_dispatcher_type": "alltoall", "moe_router_dtype": "fp32", "moe_permute_fusion": False,
                      "apply_rope_fusion": False, "gradient_accumulation_fusion": False,
                      "bias_activation_fusion": False, "bias_dropout_fusion": False}
    assert "moe_router_dtype" not in performance.transformer_config_fields(_cfg(), is_moe=False)
    assert performance.ddp_config_fields(_cfg("performance.overlap_grad_reduce=true")) == {
        "overlap_grad_reduce": True, "overlap_param_gather": False}
    assert performance.transformer_config_fields(_cfg("performance.moe_router_dtype=none"))["moe_router_dtype"] is None


@pytest.mark.parametrize("overrides, world, message", [
    (["performance.moe_token_dispatcher=ring"], 1, r"performance.moe_token_dispatcher='ring' is not one of"),
    (["performance.moe_router_dtype=bf16"], 1, r"performance.moe_router_dtype='bf16' is not one of"),
    (["performance.moe_token_dispatcher=flex"], 1, r"moe_token_dispatcher=flex needs parallel.tensor\*expert > 1"),
    (["performance.moe_token_dispatcher=flex", "parallel.expert=2"], 2,
     r"moe_token_dispatcher=flex with moe_flex_backend=deepep needs CUDA and the deep_ep package"),
    (["performance.overlap_param_gather=true", "parallel.distributed_optimizer=false"], 1,
     r"overlap_param_gather=true needs parallel.distributed_optimizer=true"),
    (["performance.moe_permute_fusion=true"], 1, r"performance.moe_permute_fusion=true needs TransformerEngine >= 2.1"),
    (["performance.apply_rope_fusion=true"], 1, r"performance.apply_rope_fusion=true needs TransformerEngine"),
    (["performance.gradient_accumulation_fusion=true"], 1,
     r"gradient_accumulation_fusion=true needs CUDA and apex's fused_weight_gradient_mlp_cuda"),
])
def test_impossible_settings_name_the_field(overrides, world, message):
    if any("fusion=true" in o for o in overrides) or "flex" in " ".join(overrides) and world > 1:
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA: the option may be available")
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(*overrides), world)
