"""The trainer's side of colocated rollouts (``rollout.colocate``; the protocol: ``rollout/colocate.py``).

The loop calls ``release`` once the step's rollout is in hand: the servers hand their weights and KV cache to
training. The weight sync (``SGLangEngine.update_weights``, method ``tensor``) gives them back: weights first, the
new ones written into them, then the KV cache. Nothing else in the loop changes.
"""

from __future__ import annotations

import torch.distributed as dist

from gspo_megatron.parallel import control
from gspo_megatron.train.startup.config import Config, ConfigError


def validate(cfg: Config) -> None:
    """What colocation needs, checked before anything starts."""
    r = cfg.rollout
    if not r.colocate:
        return
    refused = [
        (r.engine != "sglang", f"rollout.engine={r.engine}", "set rollout.engine=sglang (the local engine already "
                                                             "shares the trainer's process)"),
        (r.mode != "sync", f"rollout.mode={r.mode}", "set rollout.mode=sync: generation ahead of the update would "
                                                     "need the memory training holds"),
        (r.partial_chunk_tokens is not None, f"rollout.partial_chunk_tokens={r.partial_chunk_tokens}",
         "unset it: carried samples would keep KV cache through the update"),
        (r.weight_sync == "disk", "rollout.weight_sync=disk", "leave rollout.weight_sync at its default: colocated "
                                                              "servers take the weights as tensor handles"),
        (bool(r.urls), f"rollout.urls={r.urls}", "leave rollout.urls empty: the trainer launches its colocated "
                                                 "servers itself (tensor handles reach servers on its own node only)"),
    ]
    for bad, what, fix in refused:
        if bad:
            raise ConfigError(f"rollout.colocate=true with {what}: {fix}")


def release(engine, cfg: Config) -> dict:
    """After the rollout (collective): rank 0's servers release their memory to training; the other ranks wait
    for it in the control group, so none allocates on a GPU before its server has let go. Returns the time taken."""
    if not cfg.rollout.colocate:
        return {}
    metrics = {}
    if dist.get_rank() == 0 and engine.colocation is not None:
        engine.colocation.release()
        metrics = {"colocate/release_seconds": engine.colocation.seconds["release"]}
    control.barrier()
    return metrics


# ---- plan: both sides' resident memory per GPU in each phase ---------------------------------------------------


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron optimizer (``ChainedOptimizer``, ``.optimizer`` wrappers) or itself."""
    if hasattr(optimizer, "chained_optimizers"):
        return [t for o in optimizer.chained_optimizers for t in _torch_optimizers(o)]
    inner = getattr(optimizer, "optimizer", None)
    return _torch_optimizers(inner) if inner is not None and inner is not optimizer else [optimizer]


def offload_optimizer_state(optimizer) -> int:
    """Move every optimizer-state tensor to pinned host memory (for the rollout, when the servers need the GPU);
    returns the bytes moved. ``reload_optimizer_state`` brings them back to where they were."""
    import torch

    moved = 0
    for opt in _torch_optimizers(optimizer):
        for state in opt.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                    host.copy_(value, non_blocking=True)
                    state[key] = (host, value.device)
                    moved += value.numel() * value.element_size()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the caching allocator's blocks go back to the driver, for SGLang to take
    return moved


def reload_optimizer_state(optimizer) -> None:
    import torch

    for opt in _torch_optimizers(optimizer):
        for state in opt.state.values():
            for key, value in state.items():
                if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], torch.Tensor):
                    state[key] = value[0].to(value[1], non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
