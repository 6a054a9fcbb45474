"""The trainable policy: Megatron GPTModel built from a Hugging Face directory, DDP, optimizer, LR schedule."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gspo_megatron.model import checkpoint, hf_files
from gspo_megatron.model.bridge import Bridge
from gspo_megatron.model.checkpoint import load_weights
from gspo_megatron.model.hf_config import read_hf_config
from gspo_megatron.model.provider import build_gpt_model
from gspo_megatron.parallel.groups import Layout
from gspo_megatron.train.startup import performance
from gspo_megatron.train.startup.config import Config, measures_volatility
from gspo_megatron.train.update import recompute

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def layout_of(cfg: Config) -> Layout:
    return Layout.of(cfg.parallel)


@dataclass
class Policy:
    model: torch.nn.Module  # DistributedDataParallel(GPTModel)
    optimizer: object  # megatron MegatronOptimizer (Chained)
    scheduler: object  # megatron OptimizerParamScheduler
    bridge: object  # gspo_megatron.model.bridge.Bridge
    spec: object  # gspo_megatron.model.hf_config.ModelSpec
    hf_dir: Path
    dtype: torch.dtype
    layout: Layout

    def write_model_info(self, directory: Path) -> None:
        """What tools/convert_megatron_to_hf.py needs next to the weights: the spec and the HF metadata."""
        info = checkpoint.CheckpointInfo(spec=self.spec, padded_vocab_size=self.bridge.padded_vocab_size,
                                         dtype=checkpoint.dtype_name(self.dtype),
                                         saved_layout=checkpoint.layout_dict(self.layout))
        checkpoint.write_info(directory, info)
        hf_files.copy_hf_metadata(self.hf_dir, Path(directory) / checkpoint.HF_DIR)


def build_policy(cfg: Config, hf_dir: str | Path) -> Policy:
    """This rank's policy, with the weights of ``hf_dir`` (or of ``model.megatron_checkpoint``).

    Megatron's process groups must already be up for ``layout_of(cfg)``.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    spec = read_hf_config(Path(hf_dir) / "config.json").named_as(hf_files.tensor_names(hf_dir))
    dtype = DTYPES[cfg.model.dtype]
    bridge = Bridge(spec)
    # Routers record (or replay) their experts through megatron's RouterReplay only when built for it.
    records_routing = bool(cfg.algo.routing_replay) or measures_volatility(cfg, spec)
    model = _starting_model(cfg, hf_dir, spec, bridge, dtype, routing_replay=records_routing)
    model.config.finalize_model_grads_func = finalize_model_grads
    o = cfg.optimizer
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=o.grad_reduce_in_fp32, use_distributed_optimizer=cfg.parallel.distributed_optimizer,
        **performance.ddp_config_fields(cfg),
    )
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    performance.wire_ddp(ddp)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
            bf16=dtype == torch.bfloat16, params_dtype=dtype,
            use_distributed_optimizer=cfg.parallel.distributed_optimizer,
            **offload_fields(cfg),
        ),
        [ddp],
    )
    updates = cfg.train.steps * cfg.algo.minibatches
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps * cfg.algo.minibatches, lr_decay_steps=max(updates, 1),
        lr_decay_style=o.lr_decay, start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=max(updates, 1),
        wd_incr_style="constant",
    )
    return Policy(ddp, optimizer, scheduler, bridge, spec, Path(hf_dir), dtype, layout_of(cfg))


def offload_fields(cfg: Config) -> dict:
    """OptimizerConfig's fields for ``optimizer.offload_fraction`` (none when it is 0). Megatron-LM requires its
    precision-aware optimizer with the offload (the distributed optimizer then hands the hybrid optimizer the bf16
    shards and their gradients, and the hybrid one keeps the fp32 masters: on the host for the offloaded share);
    the copies to and from the host overlap the CPU's steps, as slime and verl run it."""
    fraction = cfg.optimizer.offload_fraction
    if not fraction:
        return {}
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction, use_precision_aware_optimizer=True,
                overlap_cpu_optimizer_d2h_h2d=True, pin_cpu_grads=True, pin_cpu_params=True)


def build_reference(cfg: Config, policy: Policy) -> torch.nn.Module:
    """The frozen reference policy of the KL term: this rank's shard of the starting weights (``model.hf_dir``
    or ``model.megatron_checkpoint``, whatever a resumed run's policy has become), in eval mode, no gradients."""
    # No routing replay: its routers would join the policy's in megatron's global RouterReplay registry.
    model = _starting_model(cfg, policy.hf_dir, policy.spec, policy.bridge, policy.dtype, routing_replay=False)
    model.requires_grad_(False)
    return model.eval()


def _starting_model(cfg: Config, hf_dir, spec, bridge, dtype, routing_replay: bool) -> torch.nn.Module:
    """This rank's GPTModel with the run's starting weights."""
    model = build_gpt_model(
        spec, layout_of(cfg), dtype=dtype, padded_vocab_size=bridge.padded_vocab_size,
        # Sequences are the unit of normalisation (train.update.loss): megatron's per-token-loss mode.
        calculate_per_token_loss=True,
        moe_enable_routing_replay=routing_replay,
        grouped_gemm=cfg.model.grouped_gemm,
        mla_down_proj_fusion=cfg.model.mla_down_proj_fusion,
        update_expert_bias=cfg.model.update_expert_bias,
        **recompute.transformer_config_fields(cfg),
        **performance.transformer_config_fields(cfg, is_moe=spec.is_moe),
    )
    if cfg.model.megatron_checkpoint:
        load_weights(model, cfg.model.megatron_checkpoint)
    else:
        bridge.load_hf_weights(model, hf_dir)
    return model
