"""Figures one GPU gives that the equality checks (``tests/gpu/paths.py``) do not, measured in one process.

    python -m tests.gpu.checks OUT.json           # on environment.device(): the GPU sizes under CUDA
    python -m tests.gpu.checks OUT.json --tiny    # the test model's sizes (the CPU mode: seconds)

``tests/gpu/test_gpu_checks.py`` runs it and judges the figures; ``bench/gpu_check.sh`` copies OUT.json out. In the
order they run (memory first, while nothing else has touched the allocator):

- ``update_step_memory``: the allocator's peak during the second of two update steps (the loop's functions:
  ``train.memory_probe.measure_training_memory``) against ``plan``'s tensor figure for the same config
  (``train.memory.estimate_memory``, megatron's local spec: no TransformerEngine on the lent machine).
- ``bf16_vs_fp32_logprobs``: the old-policy pass (``logprob_pass``) of one set of HF weights built as an fp32 and
  as a bf16 policy, on one batch: per-token and per-sequence (GSPO's unit: the mean over the response) differences.
- ``triton_in_update_step``: one clipped ``update_step`` of a fresh bf16 policy, counting the Triton kernels' launches
  (``ops._triton_kernels``: forward statistics, logits gradient), against the same step with the torch backend.
  On the CPU the kernels run under Triton's interpreter in fp32 (it cannot run a bf16 ``tl.dot``).
- ``weight_export``: the loop's weight sync (``train.rollout_phase.sync_weights``) into ``CopyReceiver``, an
  in-process engine that copies every tensor into a buffer of its own on the device, as a server's load does:
  bytes per second of export + copy; every HF tensor of the bridge's, in its shape, once.

The GPU-only part is which device runs and the sizes (``SIZES``); everything else runs in the CPU mode too.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

TINY = "--tiny" in sys.argv
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

# (HF sizes for rewards.synthetic.save_tiny_model, padded sequence length). GPU: a 204M-parameter Qwen3-MoE
# (bench/weight_sync.py's), 8 sequences of 1024 tokens per step; tiny: the test model, 8 of 32.
SIZES = {
    "gpu": (dict(vocab_size=32000, hidden_size=1024, num_layers=5, num_heads=16, num_kv_heads=4, head_dim=64,
                 num_experts=16, top_k=4, moe_intermediate_size=512, max_position_embeddings=4096,
                 initializer_range=0.02), 1024),
    "tiny": (dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  num_experts=4, top_k=2, moe_intermediate_size=32, max_position_embeddings=512), 32),
}
# 8 sequences per step in 2 minibatches of 2 micro batches (bench/plan_memory.py's layout)
BASE = ["data.task=reverse", "rollout.prompts_per_step=2", "rollout.group_size=4", "algo.minibatches=2",
        "parallel.micro_batch_size=2", "parallel.distributed_optimizer=false"]
EXPORT_ROUNDS = 3  # the first allocates the receiver's buffers and is not counted


def sizes() -> tuple[dict, int]:
    return SIZES["tiny" if TINY or not torch.cuda.is_available() else "gpu"]


def dtype_name() -> str:
    """The training dtype checked: bf16 on a GPU; fp32 on the CPU (Triton's interpreter has no bf16 dot)."""
    return "bfloat16" if torch.cuda.is_available() else "float32"


def config(hf_dir: str, dtype: str, *overrides: str):
    from gspo_megatron.train.startup.config import load_config

    return load_config(None, [*BASE, f"model.hf_dir={hf_dir}", f"model.dtype={dtype}", *overrides])


def rollout(cfg, hf_dir: str, seq_len: int) -> dict:
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.plan.probe import synthetic_rollout

    return synthetic_rollout(cfg, read_hf_config(Path(hf_dir) / "config.json").vocab_size, seq_len)


def update_step_memory(hf_dir: str, seq_len: int) -> dict:
    from gspo_megatron.plan.probe import compare_with_plan, measure_training_memory

    cfg = config(hf_dir, dtype_name())
    measured = measure_training_memory(cfg, hf_dir, seq_len)
    measured["pipeline_rank"] = 0
    row = compare_with_plan(cfg, 1, seq_len, hf_dir, [measured])["rows"][0]
    return {"seq_len": seq_len, "dtype": cfg.model.dtype, **{k: row[k] for k in (
        "measured_peak", "plan_peak", "peak_ratio", "measured_above_state", "plan_above_state",
        "above_state_ratio", "measured_state", "plan_state")}}


def old_pass(hf_dir: str, dtype: str, batch: dict) -> torch.Tensor:
    """The loop's old-policy pass (``update.passes.old_logprobs``) of a policy built from ``hf_dir`` in ``dtype``:
    [B, S] fp32 log-probs on the CPU."""
    from gspo_megatron.train.update import passes, rows as row_plans
    from gspo_megatron.train.startup.bootstrap import loss_config
    from gspo_megatron.train.startup.policy import build_policy

    cfg = config(hf_dir, dtype)
    policy = build_policy(cfg, hf_dir)
    rows = row_plans.row_plan(batch["input_ids"].shape[0], cfg)
    passes.old_logprobs(policy, batch, rows, cfg, loss_config(cfg), {})
    return batch.pop("old_logprobs").float().cpu()


def bf16_vs_fp32_logprobs(bf16: torch.Tensor, fp32: torch.Tensor, mask: torch.Tensor) -> dict:
    """Per-token and per-sequence (GSPO's unit: the mean over the response) differences of two [B, S] passes."""
    diff = (bf16 - fp32).abs()[mask]
    per_sequence = ((bf16 - fp32) * mask).sum(1) / mask.sum(1).clamp(min=1)
    return {"tokens": int(mask.sum()), "finite": bool(torch.isfinite(bf16[mask]).all()),
            "token_max_abs": diff.max().item(), "token_mean_abs": diff.mean().item(),
            "sequence_mean_max_abs": per_sequence.abs().max().item(), "fp32_token_mean": fp32[mask].mean().item()}


@contextmanager
def counted_kernels(backend: str):
    """Count the Triton kernels' launches (forward statistics, logits gradient) while ``backend`` stands for the
    op's "auto" (``ops.logprob.select_backend``, as the sequence loss imports it too). Yields the counts."""
    from gspo_megatron.ops import _triton_kernels as kernels
    from gspo_megatron.ops import logprob, sequence_loss

    counts = {"shard_stats": 0, "logits_grad": 0}
    originals = {name: getattr(kernels, name) for name in counts}
    select = logprob.select_backend

    def counting(name):
        def launch(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return launch

    def forced(choice, device, dtype, weight_dtype=None):
        return select(backend if choice == "auto" else choice, device, dtype, weight_dtype)

    for name in counts:
        setattr(kernels, name, counting(name))
    logprob.select_backend = sequence_loss.select_backend = forced
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(kernels, name, original)
        logprob.select_backend = sequence_loss.select_backend = select


def update(hf_dir: str, batch: dict, backend: str):
    """One clipped ``update_step`` on the batch's first minibatch of a fresh policy, the op's "auto" backend standing
    for ``backend``: (figures with the kernels' launch counts, the policy after the step)."""
    from gspo_megatron.train.update import passes, rows as row_plans
    from gspo_megatron.train.startup.bootstrap import loss_config
    from gspo_megatron.train.startup.policy import build_policy
    from gspo_megatron.train.update.schedules import update_step

    cfg = config(hf_dir, dtype_name())
    policy = build_policy(cfg, hf_dir)
    rows = row_plans.row_plan(batch["input_ids"].shape[0], cfg)
    with counted_kernels(backend) as counts:
        out = update_step(policy.model, policy.optimizer, row_plans.micro_batches(batch, rows[0], cfg),
                          loss_config(cfg))
    return {"kernels": dict(counts), "loss": float(out["loss"]), "grad_norm": float(out["grad_norm"]),
            "update_successful": bool(out["update_successful"]),
            "seq_log_ratio": out["seq_log_ratio"].float().cpu().tolist()}, policy


class CopyReceiver:
    """An in-process engine for ``sync_weights``: every tensor of an update is copied into a buffer of its own on
    the tensor's device (allocated by the first update), as a server's weight load copies into its parameters."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}
        self.version = "0"

    def weight_version(self) -> str:
        return self.version

    def update_weights(self, named_tensors, version: str):
        from gspo_megatron.rollout import SyncStats

        start = time.perf_counter()
        count = size = 0
        for name, tensor in named_tensors:
            buffer = self.buffers.get(name)
            if buffer is None:
                buffer = self.buffers[name] = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            buffer.copy_(tensor)
            count += 1
            size += tensor.numel() * tensor.element_size()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.version = str(version)
        return SyncStats("in-process", self.version, time.perf_counter() - start, count, size, 1)


def weight_export(policy) -> dict:
    from gspo_megatron.train.weight_sync.sync import sync_weights

    receiver = CopyReceiver()
    rounds = [sync_weights(policy, receiver, version) for version in range(1, EXPORT_ROUNDS + 1)]
    counted = rounds[1:]
    shapes = {name: tuple(shape) for name, shape in policy.bridge.hf_tensor_shapes().items()}
    dtypes: dict[str, int] = {}
    for tensor in receiver.buffers.values():
        key = str(tensor.dtype).removeprefix("torch.")
        dtypes[key] = dtypes.get(key, 0) + 1
    return {
        "tensors": len(receiver.buffers), "dtypes": dtypes,  # norms stay fp32 in a bf16 model
        "bytes": sum(t.numel() * t.element_size() for t in receiver.buffers.values()),
        "shapes_match": {name: tuple(t.shape) for name, t in receiver.buffers.items()} == shapes,
        "buffer_devices": sorted({t.device.type for t in receiver.buffers.values()}),
        "version": receiver.version,
        "bytes_per_s": statistics.median(r["weight_sync/gb_per_s"] for r in counted) * 1e9,
        "seconds": [r["weight_sync/seconds"] for r in counted],
    }


def main(out: str) -> None:
    from gspo_megatron import environment
    from gspo_megatron.parallel import groups
    from gspo_megatron.rewards.synthetic import save_tiny_model

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in the bf16-fp32 comparison
    torch.backends.cudnn.allow_tf32 = False
    groups.init_distributed()
    groups.init_model_parallel(groups.Layout(), seed=1234)
    hf_sizes, seq_len = sizes()
    hf_dir = str(save_tiny_model(Path(out).parent / "checks_model", seed=0, **hf_sizes))
    results = {"device": str(environment.device()), "sizes": hf_sizes, "seconds": {}}
    clock = [time.perf_counter()]

    def done(name: str, figures: dict) -> None:
        results[name] = figures
        now = time.perf_counter()
        results["seconds"][name] = now - clock[0]
        print(f"{name}: {now - clock[0]:.1f} s", flush=True)
        clock[0] = now

    # First, while nothing else has touched the allocator. Five policies are built after it (each from hf_dir).
    done("update_step_memory", update_step_memory(hf_dir, seq_len))
    batch = rollout(config(hf_dir, "float32"), hf_dir, seq_len)
    passes = {dtype: old_pass(hf_dir, dtype, batch) for dtype in ("float32", "bfloat16")}
    done("bf16_vs_fp32_logprobs", bf16_vs_fp32_logprobs(passes["bfloat16"], passes["float32"], batch["loss_mask"]))
    # pi_old a little off the policy's own, so that the ratios (and the clip) have something to do
    old = passes[dtype_name()]
    batch["old_logprobs"] = old + 1e-3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
    triton, _ = update(hf_dir, batch, "triton")
    reference, policy = update(hf_dir, batch, "torch")
    done("triton_in_update_step", {"dtype": dtype_name(), "triton": triton, "torch": reference})
    done("weight_export", weight_export(policy))  # the weights after one step: any will do
    Path(out).write_text(json.dumps(results, indent=1))
    groups.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
