"""Measure what ``plan`` estimates: the bytes a training rank holds, and their high-water mark.

On a GPU that is the caching allocator's own count (``torch.cuda.memory_allocated`` / ``max_memory_allocated``).
A CPU has no such counter (the CPU allocator reports nothing to Python and RSS mixes in malloc caching), so
``LiveTensorBytes`` counts it at the dispatcher: every storage an aten op creates while the mode is active is
added when it appears and subtracted when it is freed (a weak reference's callback), resizes included. That is
the CPU analogue of the CUDA allocator's "allocated" figure: live tensor bytes, without allocator slack. It sees
autograd's backward too (on CPU the engine runs on the calling thread, and dispatch modes follow it there).

    with peak_memory() as mem:
        ...                      # build the policy, run steps
        mem.reset_peak()
        ...
        mem.peak, mem.current    # bytes
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Live bytes of the CPU tensor storages created while active, and their peak.

    A storage is counted when an op returns it and no input of that op shares it (views and in-place ops return
    their input's storage: counted once, when it was created). Storages created before the mode, or outside aten
    ops (unpickled, ``torch.frombuffer``), are not counted.
    """

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (weak ref, bytes counted)
        self._real_resize = None

    def reset_peak(self) -> None:
        self.peak = self.current

    def _freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        entry = self._live.get(key)
        if entry is not None and entry[0]() is storage:
            return
        nbytes = storage.nbytes()
        self._live[key] = (weakref.ref(storage, lambda _, key=key: self._freed(key)), nbytes)
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._live.get(id(storage))
        if entry is not None and entry[0]() is storage:
            self.current += storage.nbytes() - entry[1]
            self._live[id(storage)] = (entry[0], storage.nbytes())
            self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if id(storage) not in inputs:
                    self._add(storage)
        return out

    def __enter__(self):
        # megatron releases and restores some buffers by resizing their storage (CheckpointWithoutOutput).
        self._real_resize = real = torch.UntypedStorage.resize_
        probe = self

        def resize_(storage, size):
            result = real(storage, size)
            probe._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._real_resize
        return super().__exit__(*exc)


class CudaAllocatorBytes:
    """The same interface over the CUDA caching allocator's counters (allocated bytes, not reserved)."""

    def __init__(self):
        self._base = 0

    @property
    def current(self) -> int:
        return torch.cuda.memory_allocated() - self._base

    @property
    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() - self._base

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def __enter__(self):
        torch.cuda.synchronize()
        self._base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        return False


@contextlib.contextmanager
def peak_memory():
    """Count this process's tensor bytes from here on: the CUDA allocator's figures on a GPU, else
    ``LiveTensorBytes``. Yields an object with ``current``, ``peak`` (bytes) and ``reset_peak()``."""
    probe = CudaAllocatorBytes() if torch.cuda.is_available() else LiveTensorBytes()
    with probe:
        yield probe


def synthetic_rollout(cfg, vocab_size: int, seq_len: int, seed: int = 0) -> dict:
    """A rollout batch of the loop's layout (``rollout.batch.samples_to_batch``): prompts_per_step * group_size
    rows padded to ``seq_len`` columns (the longest row has exactly that many tokens), random tokens, prompts of
    1/8 to 1/4 of the length, then the response."""
    g = torch.Generator().manual_seed(seed)
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    tokens = torch.randint(0, vocab_size, (rows, seq_len + 1), generator=g)
    prompt = torch.randint(max(1, seq_len // 8), max(2, seq_len // 4), (rows,), generator=g)
    length = torch.randint(seq_len // 2, seq_len + 1, (rows,), generator=g)
    length[0] = seq_len
    positions = torch.arange(seq_len).unsqueeze(0)
    loss_mask = (positions >= prompt.unsqueeze(1) - 1) & (positions < length.unsqueeze(1) - 1)
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "rollout_logprobs": -torch.rand(rows, seq_len, generator=g) * loss_mask,
        "advantages": torch.randn(rows, generator=g),
        "prompt_lengths": prompt,
        "response_lengths": length - prompt,
    }


def measure_training_memory(cfg, hf_dir: str, seq_len: int, update_steps: int = 2) -> dict:
    """Bytes this rank holds while it trains ``cfg`` on a rollout padded to ``seq_len`` (run under megatron's
    groups for the config's layout, e.g. through ``parallel.launch.run_on_ranks``).

    The loop's own functions run: ``build_policy`` (and ``build_reference`` when ``algo.kl_coef > 0``), the
    old-policy (and reference) log-prob pass, then ``update_steps`` update steps on the rollout's first
    minibatches. Returns bytes: ``model`` (after building: weights, gradient buffers, the reference),
    ``logprob_pass_peak``, ``update_peaks`` (one per step: the first step also creates the optimizer state, so the
    second is the steady state) and ``state`` (after the last step: weights, gradients and optimizer state).
    """
    import gc
    from pathlib import Path

    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.train.update import passes
    from gspo_megatron.train.update.rows import micro_batches, row_plan
    from gspo_megatron.train.startup.bootstrap import loss_config
    from gspo_megatron.train.startup.policy import build_policy, build_reference
    from gspo_megatron.train.update.schedules import update_step

    algo = loss_config(cfg)
    spec = read_hf_config(Path(hf_dir) / "config.json")
    batch = synthetic_rollout(cfg, spec.vocab_size, seq_len)
    if cfg.algo.replays_rollout_routing:  # the engine's experts: k distinct random ones per token and layer
        shape = batch["input_ids"].shape + (spec.num_layers, spec.num_experts)
        batch["rollout_routing"] = torch.rand(shape).argsort(dim=-1)[..., :spec.moe_topk].to(torch.int16)
    out: dict = {"update_peaks": []}
    with peak_memory() as mem:
        policy = build_policy(cfg, hf_dir)
        reference = build_reference(cfg, policy) if cfg.algo.kl_coef else None
        gc.collect()
        out["model"] = mem.current
        mem.reset_peak()
        rows = row_plan(batch["input_ids"].shape[0], cfg)
        passes.old_logprobs(policy, batch, rows, cfg, algo, {})
        if reference is not None:
            passes.reference_logprobs(reference, batch, rows, cfg, algo, {})
        out["logprob_pass_peak"] = mem.peak
        for minibatch_rows in rows[:update_steps]:
            gc.collect()
            mem.reset_peak()
            update_step(policy.model, policy.optimizer, micro_batches(batch, minibatch_rows, cfg), algo)
            out["update_peaks"].append(mem.peak)
        gc.collect()
        out["state"] = mem.current
    return out


def measure_layouts(cases: list, hf_dir: str) -> list[dict]:
    """A rank function for ``parallel.launch.run_on_ranks(measure_layouts, world, None, cases, hf_dir)``: for each
    (cfg, seq_len), build megatron's groups for the config's layout, then ``measure_training_memory``. Returns this
    rank's measurements, each with its pipeline stage."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.parallel import groups
    from gspo_megatron.train.startup.policy import layout_of

    out = []
    for cfg, seq_len in cases:
        groups.init_model_parallel(layout_of(cfg), seed=cfg.train.seed)
        measured = measure_training_memory(cfg, hf_dir, seq_len)
        measured["pipeline_rank"] = ps.get_pipeline_model_parallel_rank()
        out.append(measured)
    return out


def compare_with_plan(cfg, world_size: int, seq_len: int, hf_dir: str, per_rank: list[dict]) -> dict:
    """``plan``'s figures (megatron's local spec: what ran) against one case's measurements on every rank.

    For the most loaded rank of each pipeline stage: the measured steady-state peak (the second update step's)
    against the estimate's tensor peak, and the part above the training state (activations and working set)
    against the estimate's. The GPU-only overhead (CUDA context, NCCL, allocator slack) is not in either."""
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.plan.memory import estimate_memory

    estimate = estimate_memory(read_hf_config(f"{hf_dir}/config.json"), cfg, world_size, seq_len, impl="local")
    stages = {0: estimate.stages[0], cfg.parallel.pipeline - 1: estimate.stages[-1]}
    rows = []
    for pp_rank, stage in stages.items():
        ranks = [m for m in per_rank if m["pipeline_rank"] == pp_rank]
        worst = max(ranks, key=lambda m: m["update_peaks"][-1])
        peak = worst["update_peaks"][-1]
        plan_state = stage.state
        rows.append({
            "stage": stage.stage, "measured_peak": peak, "plan_peak": stage.tensors,
            "peak_ratio": peak / stage.tensors,
            "measured_above_state": peak - worst["state"], "plan_above_state": stage.tensors - plan_state,
            "above_state_ratio": (peak - worst["state"]) / (stage.tensors - plan_state),
            "measured_state": worst["state"], "plan_state": plan_state,
            "spread": max(m["update_peaks"][-1] for m in ranks) / min(m["update_peaks"][-1] for m in ranks),
        })
        if cfg.parallel.pipeline == 1:
            break
    return {"rows": rows, "estimate": estimate}
