"""The device paths of one process, on a tiny Qwen3-MoE, saved for comparison (``tests/gpu/test_gpu_paths.py``).

    python -m tests.gpu.paths HF_DIR OUT.pt [policy]

Runs on whatever ``environment.device()`` is: the GPU test runs it once on the GPU and once with CUDA hidden
(the CPU reference), on the same weights and batch. World of one (NCCL on the GPU, gloo on the CPU):

- the trainer's policy (``train.startup.policy.build_policy``: provider, bridge, DDP, Megatron optimizer) in fp32 with
  the plain (non-distributed) optimizer, whose MoE router weights megatron creates on the CPU;
- a rollout minibatch of CPU tensors, as the loop has it: ``logprob_pass`` (old policy, with entropy) and one
  clipped ``update_step`` (Adam's eps at 1, so the step is continuous in the gradient and comparable across
  devices), the updated weights exported through the bridge;
- the same in bf16 (the CUDA dtype users train in): finite, and close to the CPU's bf16;
- ``score`` (Megatron) on the HF directory, against ``transformers``;
- the fp32 policy on packed rows (``pack=True``: TE's THD attention with TransformerEngine, else the mask);
- with TransformerEngine: the fp32 policy run again with grouped-GEMM experts and with SequentialMLP, and with
  TE's fusions (``performance``: permutation, RoPE) on and off;
- under CUDA: the distributed optimizer's step with the optimizer state in host memory (``optimizer.offload_fraction``
  1, and 0.5 in bf16, with bf16 gradient buffers) and without (0), where each run's Adam state lives recorded.
Where every tensor lives is recorded too (parameters, what the passes return). ``policy``: the fp32 and bf16 policy
runs only (the gated-DeltaNet hybrid's check, ``tests/gpu/test_gpu_deltanet.py``), with the module of the delta rule
megatron called (fla's Triton kernel on the GPU, ``ops.gated_delta_rule`` on the CPU).
"""

from __future__ import annotations

import sys

import torch

VOCAB, SEQ, SEQUENCES, MICRO = 128, 16, 8, 2
TE_FUSIONS = ("moe_permute_fusion", "apply_rope_fusion")


def rollout(vocab_size: int = VOCAB) -> dict:
    """CPU tensors, like the loop's rollout batch: prompts of 3-8 tokens, then responses, sequences of 10-16 tokens
    (``seq_lengths``: what packed rows hold; padded rows carry tokens after the end that nothing attends to)."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, vocab_size - 1, (SEQUENCES, SEQ + 1), generator=g)
    prompt = torch.randint(3, 9, (SEQUENCES,), generator=g)
    lengths = torch.randint(10, SEQ + 1, (SEQUENCES,), generator=g)
    t = torch.arange(SEQ).unsqueeze(0)
    return {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": (t + 1 >= prompt.unsqueeze(1)) & (t + 1 < lengths.unsqueeze(1)),
        "advantages": torch.randn(SEQUENCES, generator=g),
        "seq_lengths": lengths,
    }


def micro_batches(batch: dict) -> list[dict]:
    return [{k: v[i:i + MICRO] for k, v in batch.items()} for i in range(0, SEQUENCES, MICRO)]


def _exported(policy) -> dict:
    return {name: t.detach().float().cpu().clone() for name, t in policy.bridge.export_hf_weights(policy.model)}


def policy_run(hf_dir: str, dtype: str, overrides: tuple[str, ...] = (), pack: bool = False) -> dict:
    from gspo_megatron.train.startup.config import load_config
    from gspo_megatron.train.startup.policy import build_policy
    from gspo_megatron.train.update.loss import LossConfig
    from gspo_megatron.train.update.schedules import logprob_pass, update_step
    from gspo_megatron.train.update.batch import schedule_packing

    cfg = load_config(None, [f"model.dtype={dtype}", "parallel.distributed_optimizer=false", "optimizer.lr=1.0",
                             "optimizer.adam_eps=1.0", "optimizer.clip_grad=0.05", "train.steps=1",
                             "algo.minibatches=1", *overrides])
    policy = build_policy(cfg, hf_dir)
    start = _exported(policy)
    batch = rollout(policy.spec.vocab_size)
    passes = logprob_pass(policy.model, micro_batches(batch), with_entropy=True, pack=pack)
    noise = 1e-3 * torch.randn(passes["logprobs"].shape, generator=torch.Generator().manual_seed(3))
    batch["old_logprobs"] = passes["logprobs"].cpu() + noise
    out = update_step(policy.model, policy.optimizer, micro_batches(batch), LossConfig(), pack=pack)
    end = _exported(policy)
    config = policy.model.config
    packed = schedule_packing(policy.model, micro_batches(batch), pack)
    return {
        "packing": None if packed is None else ("thd" if packed.thd else "mask"),
        "fusions": {k: getattr(config, k) for k in TE_FUSIONS + ("bias_activation_fusion", "bias_dropout_fusion")},
        "expert_params": sorted(n for n, _ in policy.model.named_parameters() if ".mlp.experts." in n),
        "param_devices": sorted({p.device.type for p in policy.model.parameters()}),
        "pass_devices": sorted({t.device.type for t in passes.values()}),
        "update_devices": sorted({v.device.type for v in out.values() if torch.is_tensor(v)}),
        "logprobs": passes["logprobs"].float().cpu(),
        "entropy": passes["entropy"].float().cpu(),
        "loss": float(out["loss"]),
        "grad_norm": out["grad_norm"],
        "update_successful": out["update_successful"],
        "seq_log_ratio": out["seq_log_ratio"].float(),
        "step": {name: end[name] - start[name] for name in start},  # the clipped update of every weight
        "end": end,
        "optimizer_state": optimizer_placement(policy.optimizer),
    }


def optimizer_placement(optimizer) -> dict:
    """The inner optimizers' classes and the elements of Adam's first moment on each device type."""
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    elements: dict[str, int] = {}
    for o in inner:
        for state in o.state.values():
            if torch.is_tensor(state.get("exp_avg")):
                kind = state["exp_avg"].device.type
                elements[kind] = elements.get(kind, 0) + state["exp_avg"].numel()
    return {"classes": sorted({type(o).__name__ for o in inner}), "exp_avg_elements": elements}


OFFLOAD = {  # the distributed optimizer (world 1: nothing to shard, the same code path), bf16 with bf16 gradients
    "fp32": ("float32", ()),
    "bf16": ("bfloat16", ("optimizer.grad_reduce_in_fp32=false",)),
}


def offload_runs(hf_dir: str) -> dict:
    """The offloaded step against the same step on the GPU (``tests/gpu/test_gpu_paths.py``): fp32 with fraction 0
    and 1 (below 1 is refused for fp32), bf16 with 0, 0.5 and 1."""
    fractions = {"fp32": (0, 1), "bf16": (0, 0.5, 1)}
    return {name: {f: policy_run(hf_dir, dtype, ("parallel.distributed_optimizer=true", *extra,
                                                 f"optimizer.offload_fraction={f}"))
                   for f in fractions[name]}
            for name, (dtype, extra) in OFFLOAD.items()}


def score_run(hf_dir: str) -> dict:
    from gspo_megatron import score
    from gspo_megatron.parallel.groups import Layout

    g = torch.Generator().manual_seed(5)
    records = [score.Record(tuple(torch.randint(0, VOCAB, (n,), generator=g).tolist()),
                            tuple(torch.randint(0, VOCAB, (m,), generator=g).tolist())) for n, m in ((3, 9), (7, 4), (1, 12))]
    model, _, _ = score.load_policy(hf_dir, Layout())
    return {"megatron": score.score_records(model, records), "transformers": score.score_with_transformers(hf_dir, records)}


def deltanet_kernel() -> str:
    """The module of the chunked delta rule megatron's GatedDeltaNet calls (0.19.2's package or 0.16.1's module)."""
    import importlib

    try:
        module = importlib.import_module("megatron.core.ssm.gated_delta_net.gdn")
    except ImportError:
        module = importlib.import_module("megatron.core.ssm.gated_delta_net")
    return getattr(module.chunk_gated_delta_rule, "__module__", "") or ""


def main(hf_dir: str, out: str, scope: str = "all") -> None:
    from gspo_megatron import environment
    from gspo_megatron.parallel import groups

    # fp32 means fp32 on both devices: TF32 would change the GPU's numbers by ~1e-3.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    groups.init_distributed()
    groups.init_model_parallel(groups.Layout(), seed=1234)
    if scope == "policy":
        results = {"device": str(environment.device()), "fp32": policy_run(hf_dir, "float32"),
                   "bf16": policy_run(hf_dir, "bfloat16"), "deltanet_kernel": deltanet_kernel()}
        torch.save(results, out)
        groups.destroy()
        return
    results = {"device": str(environment.device()), "fp32": policy_run(hf_dir, "float32"),
               "bf16": policy_run(hf_dir, "bfloat16"), "score": score_run(hf_dir),
               # packed rows: TransformerEngine's THD attention where it imports, else the block-diagonal mask
               "packed": policy_run(hf_dir, "float32", pack=True)}
    if environment.transformer_engine_available():  # the grouped-GEMM experts (TEGroupedMLP) against SequentialMLP
        results["grouped"] = {grouped: policy_run(hf_dir, "float32", (f"model.grouped_gemm={grouped}",))
                              for grouped in ("true", "false")}
        results["te_fusions"] = {on: policy_run(hf_dir, "float32", tuple(f"performance.{f}={on}" for f in TE_FUSIONS))
                                 for on in ("true", "false")}
    if torch.cuda.is_available():  # megatron's HybridDeviceOptimizer runs on CUDA streams only
        results["offload"] = offload_runs(hf_dir)
    torch.save(results, out)
    groups.destroy()


if __name__ == "__main__":
    main(*sys.argv[1:4])
