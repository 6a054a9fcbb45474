"""Training checkpoints: model, optimizer, LR schedule, RNG states and trainer state, written atomically.

Layout of ``checkpoint.dir``:

    step_000010/          a torch_dist checkpoint (megatron dist_checkpointing): model + optimizer shards,
                          the LR schedule, trainer state (step, data position, weight version), and each
                          rank's RNG states
    step_000020/
    latest                the name of the newest complete checkpoint

A save goes to ``step_N.tmp/``, then rank 0 renames it to ``step_N/`` and replaces ``latest`` (write to a
temporary file, then ``os.replace``). A process killed at any point leaves ``latest`` naming a complete
checkpoint, so ``--resume`` always has one to load; stale ``*.tmp`` directories are removed by the next save.

Asynchronous saves (``checkpoint.async_save``, megatron's async torch_dist save): ``save`` returns once each rank's
tensors are in host memory (copied from the GPU; on a CPU, a forked writer's copy-on-write snapshot) and a
background process writes them; ``finalize_saves`` (every step, collective) renames the checkpoint and moves
``latest`` once every rank has written its part. One save is in flight at a time: the next ``save`` completes
the previous one first.

Over 350 lines because the synchronous and asynchronous saves, the atomic rename and the loads (with the checks
of what a resumed run may take) share their layout and must change together.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path
from functools import partial
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from gspo_megatron.model.checkpoint import LATEST, tensors_state_dict
from gspo_megatron.model.hidden_output import unwrap
from gspo_megatron.parallel import control
from gspo_megatron.train.resilience import fault_injection
# The distributed optimizer's state as one ShardedTensor per contiguous buffer: fully parallel save and load
# with no gather (Megatron-LM's default). It can be resumed under another data-parallel size, not another
# TP/PP/EP layout; convert the model alone (tools/) to change those.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


class SaveClock:
    """``checkpoint.every_minutes``: whether that long has passed since the last save, by rank 0's clock, the same
    answer on every rank (a broadcast over the control group; the ranks' clocks differ)."""

    def __init__(self, minutes: float):
        self.seconds, self.last = minutes * 60, time.monotonic()

    def due(self) -> bool:
        if not self.seconds:
            return False
        flag = torch.tensor([float(time.monotonic() - self.last >= self.seconds)])
        if dist.is_initialized():
            dist.broadcast(flag, src=0, group=control.group())
        return bool(flag.item())

    def saved(self) -> None:
        self.last = time.monotonic()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    """In the control group: the others wait here for rank 0's file-system work (pruning old checkpoints of
    terabytes can take minutes), where no NCCL watchdog fires."""
    if dist.is_initialized():
        control.barrier()


def rng_states() -> dict:
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_states(states: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"]:
        torch.cuda.set_rng_state_all(states["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["megatron_tracker"])


def _rng_sharded_object(states: dict | None):
    """Each rank's RNG states as one ShardedObject indexed by global rank (every rank restores its own)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world = dist.get_world_size() if dist.is_initialized() else 1
    return ShardedObject("rng_state", states, (world,), (_rank(),), replica_id=0)


def _sharded_state(model, optimizer, scheduler, trainer_state: dict | None, rng: dict | None, is_loading: bool):
    # The model part is exactly a converted model checkpoint's (tensors only, per-layer keys), so
    # tools/convert_megatron_to_hf.py reads a training checkpoint as it is.
    model_sd = tensors_state_dict(model)
    state = {"model": model_sd, "rng_state": _rng_sharded_object(rng)}
    if optimizer is not None:
        # A fresh copy: megatron writes the current data-parallel group into the dict it is given.
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA))
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict() if not is_loading else {}
    if trainer_state is not None:
        state["trainer"] = trainer_state
    return state


def save(directory: str | Path, step: int, model, optimizer, scheduler, trainer_state: dict, keep: int = 2,
         model_info: Callable[[Path], None] | None = None, async_save: bool = False) -> Path:
    """Save a complete checkpoint for ``step``; returns its directory. Collective: call on every rank.

    ``model_info(tmp_dir)``, called on rank 0 before the rename, writes what rebuilds the model (the
    conversion tool's ``gspo_megatron.json`` and ``hf/``), so the checkpoint converts to HF directly.
    ``async_save``: write in the background; the directory is complete (and ``latest``) after ``finalize_saves``.
    """
    from megatron.core import dist_checkpointing

    from gspo_megatron.train.startup.performance import params_current
    from patches import megatron_checkpoint_writer

    megatron_checkpoint_writer.apply()  # the writer's helper process dies with this rank, even SIGKILLed
    finalize_saves(blocking=True)
    params_current(model)  # the optimizer's latest weights, also under overlap_param_gather
    root = Path(directory)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    # Before the first optimizer step there is no optimizer state to save (and megatron cannot write an empty
    # one); the checkpoint says so, and loading it leaves the fresh optimizer as it is.
    has_optimizer_state = _has_optimizer_state(optimizer)
    trainer_state = dict(trainer_state, step=step, has_optimizer_state=has_optimizer_state)
    state = _sharded_state(model, optimizer if has_optimizer_state else None, scheduler, trainer_state, rng_states(),
                           is_loading=False)
    publish = partial(_publish, root, tmp, final, keep, model_info)
    if not async_save:
        dist_checkpointing.save(state, str(tmp))
        fault_injection.at("checkpoint_written", step)  # the soak run's schedule (GSPO_FAULTS)
        publish()
        return final
    request = dist_checkpointing.save(state, str(tmp), async_sharded_save=True, **_async_strategy())
    request.finalize_fns.append(publish)  # after megatron's own (the global metadata), on every rank
    _async_queue().schedule_async_request(request)
    return final


def _publish(root: Path, tmp: Path, final: Path, keep: int, model_info) -> None:
    """Every rank has written ``tmp``: rank 0 completes it, renames it to ``final`` and points ``latest`` at it."""
    _barrier()
    if _rank() == 0:
        if model_info is not None:
            model_info(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / f"{LATEST}.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / LATEST)
        _prune(root, keep)
    _barrier()


_queue = None  # megatron's AsyncCallsQueue of this process, created by the first asynchronous save


def _async_strategy() -> dict:
    """megatron-core 0.19 has two async writers: nvidia-resiliency-ext's where installed, else its own (``mcore``,
    deprecated there but the only one without that package); 0.16.1 has only its own and no such argument."""
    import inspect

    from megatron.core import dist_checkpointing

    if "async_strategy" not in inspect.signature(dist_checkpointing.save).parameters:
        return {}
    from megatron.core.dist_checkpointing.strategies.nvrx import has_nvrx_async_support

    return {"async_strategy": "nvrx" if has_nvrx_async_support() else "mcore"}


def _async_queue():
    global _queue
    if _queue is None:
        strategy = _async_strategy().get("async_strategy")
        if strategy is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        else:
            from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

            _, AsyncCallsQueue = get_async_strategy(strategy, "AsyncCallsQueue")
        _queue = AsyncCallsQueue()
    return _queue


def finalize_saves(blocking: bool = False) -> int:
    """Complete the asynchronous saves every rank has finished writing (all of them with ``blocking``): rename,
    ``latest``, pruning. Collective (every rank, at the same points); a no-op without asynchronous saves. Returns
    how many are still being written."""
    if _queue is None or not _queue.get_num_unfinalized_calls():
        return 0
    _queue.maybe_finalize_async_calls(blocking=blocking)
    return _queue.get_num_unfinalized_calls()


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    steps = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory``, or None."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    path = Path(directory) / pointer.read_text().strip()
    if not path.is_dir():
        raise FileNotFoundError(f"{pointer} names {path.name}, which does not exist: the checkpoint dir was edited")
    return path


def damage(path: str | Path) -> str | None:
    """What is missing or cut short in a checkpoint dir, from its file listing and torch_dist's index (every shard
    file as long as the byte ranges it is said to hold), without loading it; None when intact."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    for name in ("metadata.json", ".metadata"):
        if not (path / name).is_file():
            return f"{path / name} is missing"
    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:  # a truncated or garbled index: pickle's and torch's errors alike
        return f"{path / '.metadata'} is unreadable ({type(e).__name__}: {e})"
    # The common (non-tensor) state: common.pt up to megatron-core 0.16; from 0.19 a "common_state" object inside
    # the torch_dist files (checked with them below).
    inline_common = any(index.fqn.startswith("common_state") for index in storage)
    if not inline_common and not (path / "common.pt").is_file():
        return f"{path / 'common.pt'} is missing"
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size < size:
            return f"{file} is cut short ({file.stat().st_size} of {size} bytes)"
    if not inline_common:
        try:
            torch.load(path / "common.pt", map_location="cpu", weights_only=False)
        except Exception as e:
            return f"{path / 'common.pt'} is unreadable ({type(e).__name__}: {e})"
    return None


def check_resumable(directory: str | Path) -> None:
    """Before anything is built: ``latest`` names an intact checkpoint, or a ``ValueError`` names the damaged file
    and the newest intact step to resume from instead."""
    root = Path(directory)
    newest = latest(root)
    problem = damage(newest) if newest is not None else None
    if problem is None:
        return
    intact = [p for p in sorted(root.glob("step_*"), reverse=True)
              if p.is_dir() and not p.name.endswith(".tmp") and p != newest and damage(p) is None]
    way_on = (f"the newest intact checkpoint is {intact[0]}: point {root / LATEST} at it "
              f"(echo {intact[0].name} > {root / LATEST}) and --resume again" if intact else
              "no other step dir there is intact: start afresh without --resume (--overwrite)")
    raise ValueError(f"--resume: the checkpoint {newest} is damaged: {problem}; {way_on}")


def _has_optimizer_state(optimizer) -> bool:
    return any(
        len(opt.optimizer.state[p])
        for opt in getattr(optimizer, "chained_optimizers", [optimizer])
        for g in opt.optimizer.param_groups
        for p in g["params"]
    )


def _init_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer zero state (Adam moments and step) so its sharded state dict has a template.

    megatron-core's non-distributed optimizer does this itself when loading; its DistributedOptimizer does
    not, and without apex/TE its ``state_dict`` asserts one common ``step`` across parameters.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if _has_optimizer_state(opt):
            continue
        if opt.init_state_fn is None and hasattr(inner, "dummy_step"):
            # optimizer.offload_fraction: megatron's HybridDeviceOptimizer has no init function; its state comes from
            # a step on random gradients (what megatron's own load does), whose weights the load then overwrites.
            inner.dummy_step()
            continue
        opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))


def _restore_steps(node) -> None:
    """Put the saved Adam step into each parameter's state, replacing ``_init_optimizer_state``'s zero.

    The distributed optimizer saves the step once, in its param groups; its parameter-state load then
    copies every key of the per-parameter template (the zero placeholder included) over the live state.
    """
    if isinstance(node, dict):
        groups = node.get("optimizer", {}).get("param_groups") if isinstance(node.get("optimizer"), dict) else None
        if "param_state" in node and groups and "step" in groups[0]:
            step = torch.tensor(float(groups[0]["step"]))
            _set_key(node["param_state"], "step", step)
        for value in node.values():
            _restore_steps(value)
    elif isinstance(node, list):
        for value in node:
            _restore_steps(value)


def _set_key(node, key: str, value: torch.Tensor) -> None:
    if isinstance(node, dict):
        if key in node:
            node[key] = value.clone()
        for child in node.values():
            _set_key(child, key, value)
    elif isinstance(node, list):
        for child in node:
            _set_key(child, key, value)


def _unshare_steps(optimizer) -> None:
    """One ``step`` tensor per parameter again.

    megatron-core's DistributedOptimizer.load_state_dict (without apex/TE) gives every parameter the same
    step tensor object; torch's Adam increments ``state["step"]`` in place once per parameter, so the
    shared counter would run ahead and the bias correction of the next step would be wrong.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def load(path: str | Path, model, optimizer, scheduler) -> dict[str, Any]:
    """Load a checkpoint into ``model``/``optimizer``/``scheduler`` and restore this rank's RNG states.

    Returns the trainer state saved with it (``step``, data position, weight version, ...).
    """
    from megatron.core import dist_checkpointing

    finalize_saves(blocking=True)
    common = dist_checkpointing.load_common_state_dict(str(path))
    with_optimizer = common.get("trainer", {}).get("has_optimizer_state", True)
    if with_optimizer:
        _init_optimizer_state(optimizer)
    template = _sharded_state(model, optimizer if with_optimizer else None, scheduler, {}, None, is_loading=True)
    loaded = dist_checkpointing.load(template, str(path))
    missing, unexpected = unwrap(model).load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]  # tensors-only checkpoints
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if with_optimizer:
        _restore_steps(loaded["optimizer"])
        with torch.no_grad():  # the distributed optimizer copies into its fp32 main params (leaves)
            optimizer.load_state_dict(loaded["optimizer"])
        _unshare_steps(optimizer)
    if scheduler is not None and loaded.get("scheduler"):
        scheduler.load_state_dict(loaded["scheduler"])
    set_rng_states(loaded["rng_state"])
    return loaded["trainer"]
