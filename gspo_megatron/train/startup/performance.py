"""Megatron-Core's speed settings: the ``performance`` config section checked, resolved for this machine, and turned
into TransformerConfig and DDP fields.

    field                         megatron field                         needs
    moe_token_dispatcher          moe_token_dispatcher_type              flex: CUDA, deep_ep, tensor*expert > 1
    moe_flex_backend              moe_flex_dispatcher_backend            (with flex)
    moe_router_dtype              moe_router_dtype                       -
    moe_permute_fusion            moe_permute_fusion                     TransformerEngine >= 2.1
    apply_rope_fusion             apply_rope_fusion                      TransformerEngine's fused RoPE
    gradient_accumulation_fusion  gradient_accumulation_fusion           CUDA, apex's fused_weight_gradient_mlp_cuda
    bias_activation_fusion        bias_activation_fusion                 - (torch.compile; None: on under CUDA)
    bias_dropout_fusion           bias_dropout_fusion                    - (torch.compile; None: on under CUDA)
    overlap_grad_reduce           DistributedDataParallelConfig's        -
    overlap_param_gather          DistributedDataParallelConfig's        parallel.distributed_optimizer

``None`` is "on where this machine can" for the fields whose requirement is the machine's; ``true`` where it
cannot is a ConfigError naming the field (megatron itself would fail deep inside model construction, or in the
first forward). ``check_performance`` runs in ``validate``, before any process group starts.

With ``overlap_param_gather`` the model's parameters are stale between the optimizer step and the next forward
(each bucket is gathered by a forward pre-hook): ``params_current(model)`` gathers them first, for whatever
reads parameters outside a forward (weight sync, checkpoints).
"""

from __future__ import annotations

import importlib.util

import torch

from gspo_megatron import environment
from gspo_megatron.train.startup.config import Config, ConfigError

DISPATCHERS = ("alltoall", "allgather", "flex")
FLEX_BACKENDS = ("deepep", "hybridep")
ROUTER_DTYPES = ("fp32", "fp64", "none")


# ---- what this machine has (each asks the package that megatron itself would use) ------------------------


def fused_permute_available() -> bool:
    """megatron's moe_utils found TransformerEngine's fused permutation kernels (TE >= 2.1)."""
    if not environment.transformer_engine_available():
        return False
    from megatron.core.transformer.moe import moe_utils

    names = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
             "fused_sort_chunks_by_index_with_probs", "fused_unpermute")
    return all(getattr(moe_utils, name, None) is not None for name in names)


def fused_rope_available() -> bool:
    """megatron's rope_utils found TransformerEngine's fused RoPE."""
    if not environment.transformer_engine_available():
        return False
    from megatron.core.models.common.embeddings import rope_utils

    return getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None


def grad_accumulation_fusion_available() -> bool:
    """apex's CUDA extension that megatron's linear layers (the output layer included) need for the fusion."""
    return torch.cuda.is_available() and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def flex_dispatcher_available(backend: str) -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("deep_ep") is None:
        return False
    if backend == "hybridep":
        try:
            from deep_ep import HybridEPBuffer  # noqa: F401
        except ImportError:
            return False
    return True


# ---- the config section ------------------------------------------------------------------------------------


def _machine_option(value: bool | None, available, name: str, needs: str) -> bool:
    """A field that depends on the machine: None -> whether it can; True where it cannot -> an error."""
    if value is None:
        return available()
    if value and not available():
        raise ConfigError(f"performance.{name}=true needs {needs}, which this machine does not have: set "
                          f"performance.{name}=null (on where available) or false")
    return bool(value)


def resolve(cfg: Config) -> dict:
    """The section with every None decided for this machine (raises ConfigError as ``check_performance``)."""
    p = cfg.performance
    if p.moe_token_dispatcher not in DISPATCHERS:
        raise ConfigError(f"performance.moe_token_dispatcher={p.moe_token_dispatcher!r} is not one of {DISPATCHERS}")
    if p.moe_flex_backend not in FLEX_BACKENDS:
        raise ConfigError(f"performance.moe_flex_backend={p.moe_flex_backend!r} is not one of {FLEX_BACKENDS}")
    if p.moe_router_dtype not in ROUTER_DTYPES:
        raise ConfigError(f"performance.moe_router_dtype={p.moe_router_dtype!r} is not one of {ROUTER_DTYPES}")
    if p.moe_token_dispatcher == "flex":
        if cfg.parallel.tensor * cfg.parallel.expert == 1:
            raise ConfigError("performance.moe_token_dispatcher=flex needs parallel.tensor*expert > 1 (megatron's "
                              "flex dispatcher sends over the TP x EP group); use alltoall")
        if not flex_dispatcher_available(p.moe_flex_backend):
            raise ConfigError(f"performance.moe_token_dispatcher=flex with moe_flex_backend={p.moe_flex_backend} "
                              "needs CUDA and the deep_ep package (DeepEP), which this machine does not have: "
                              "use alltoall")
    if p.overlap_param_gather and not cfg.parallel.distributed_optimizer:
        raise ConfigError("performance.overlap_param_gather=true needs parallel.distributed_optimizer=true (it "
                          "overlaps the distributed optimizer's parameter all-gather with the next forward)")
    cuda = torch.cuda.is_available
    return dict(
        moe_token_dispatcher=p.moe_token_dispatcher,
        moe_flex_backend=p.moe_flex_backend,
        moe_router_dtype=None if p.moe_router_dtype == "none" else p.moe_router_dtype,
        moe_permute_fusion=_machine_option(p.moe_permute_fusion, fused_permute_available, "moe_permute_fusion",
                                           "TransformerEngine >= 2.1 (its fused permutation kernels)"),
        apply_rope_fusion=_machine_option(p.apply_rope_fusion, fused_rope_available, "apply_rope_fusion",
                                          "TransformerEngine (its fused RoPE kernel)"),
        gradient_accumulation_fusion=_machine_option(
            p.gradient_accumulation_fusion, grad_accumulation_fusion_available, "gradient_accumulation_fusion",
            "CUDA and apex's fused_weight_gradient_mlp_cuda extension"),
        bias_activation_fusion=cuda() if p.bias_activation_fusion is None else p.bias_activation_fusion,
        bias_dropout_fusion=cuda() if p.bias_dropout_fusion is None else p.bias_dropout_fusion,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
    )


def check_performance(cfg: Config) -> None:
    """Raise ConfigError naming the ``performance.*`` field megatron would reject or this machine cannot run."""
    resolve(cfg)


def transformer_config_fields(cfg: Config, is_moe: bool = True) -> dict:
    """The TransformerConfig fields of ``cfg.performance`` (the MoE ones only for MoE models: megatron checks
    some of them against the experts)."""
    r = resolve(cfg)
    fields = dict(gradient_accumulation_fusion=r["gradient_accumulation_fusion"],
                  apply_rope_fusion=r["apply_rope_fusion"], bias_activation_fusion=r["bias_activation_fusion"],
                  bias_dropout_fusion=r["bias_dropout_fusion"])
    if is_moe:
        fields.update(moe_token_dispatcher_type=r["moe_token_dispatcher"], moe_router_dtype=r["moe_router_dtype"],
                      moe_permute_fusion=r["moe_permute_fusion"])
        if r["moe_token_dispatcher"] == "flex":
            fields["moe_flex_dispatcher_backend"] = r["moe_flex_backend"]
    return fields


def ddp_config_fields(cfg: Config) -> dict:
    """The DistributedDataParallelConfig fields of ``cfg.performance``."""
    r = resolve(cfg)
    return dict(overlap_grad_reduce=r["overlap_grad_reduce"], overlap_param_gather=r["overlap_param_gather"])


def wire_ddp(ddp) -> None:
    """What megatron's schedules need from the model config to overlap DDP's communication (Megatron-LM's
    training.py sets the same): ``no_sync`` so micro batches before the last accumulate without reducing, and
    under pipeline parallelism ``start_grad_sync`` so the last stage's reduction starts when its backward ends."""
    config = ddp.config  # the model's TransformerConfig (the one the schedules read)
    if ddp.ddp_config.overlap_grad_reduce:
        config.no_sync_func = ddp.no_sync
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() > 1:
            config.grad_sync_func = ddp.start_grad_sync


def params_current(model) -> None:
    """Make ``model``'s parameters the optimizer's latest values. Under ``overlap_param_gather`` the distributed
    optimizer leaves the all-gather of updated parameters to the next forward's pre-hooks: gather them now
    (synchronously; the next forward then finds them gathered). A no-op otherwise."""
    if getattr(model, "use_forward_hook", False):
        model.start_param_sync(force_sync=True)
