"""The rollout engine, on global rank 0: SGLang servers (attached by URL, or launched and, under torchrun restarts,
kept) or the local engine; every other rank gets None and waits in the control group until it is up."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.parallel import control
from gspo_megatron.rollout import LocalEngine, SGLangConfig, SGLangEngine, WeightSyncConfig
from gspo_megatron.train.resilience import elastic, preemption
from gspo_megatron.train.startup.config import Config, ConfigError


def make_engine(cfg: Config, hf_dir: str | Path, tokenizer):
    """The configured engine on global rank 0, None elsewhere (collective: the others wait until it is up)."""
    from gspo_megatron.train.sampling import colocate
    from gspo_megatron.train.startup.bootstrap import engine_model_dir

    hf_dir = engine_model_dir(cfg, Path(hf_dir))  # an FP8 checkpoint's dequantized copy: the weights we train

    if colocate.on_several_nodes(cfg):  # rollout.colocate: each node's leader launches its servers (colocate.py)
        return colocate.engine_on_each_node(cfg, sglang_config(cfg, hf_dir))
    engine = _engine(cfg, hf_dir, tokenizer) if dist.get_rank() == 0 else None
    control.barrier()
    return engine


def _engine(cfg: Config, hf_dir: str | Path, tokenizer):
    if cfg.rollout.engine == "local":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
        return LocalEngine(model, tokenizer, seed=cfg.train.seed, version="0",
                           rollout_routing=cfg.algo.replays_rollout_routing)
    config = sglang_config(cfg, hf_dir)
    refuse_colocation(config, trainer_gpus=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    # under torchrun --max-restarts: servers kept through a restart of the workers (adopted), or launched to be kept
    servers = None if config.urls else elastic.servers(cfg, config)
    # A scheduler's SIGTERM while the servers start stops the wait (caught by preemption: nothing to save yet).
    engine = SGLangEngine(config, servers=servers, stop=preemption.requested)
    if servers is not None:  # kept servers (torchrun restarts): one relaunched after a failure is recorded anew
        engine.on_relaunch = lambda: elastic.record_servers(cfg, engine.servers)
    return engine


def sglang_config(cfg: Config, hf_dir: str | Path):
    """The SGLang engine's configuration from ``cfg.rollout``."""
    server_args = dict(cfg.rollout.server_args)
    server_args.setdefault("seed", cfg.train.seed)
    for name in ("max_server_restarts", "restart_window_s", "attached_wait_s"):  # fault tolerance
        server_args.setdefault(name, getattr(cfg.rollout, name))
    if cfg.algo.replays_rollout_routing:  # the servers return the experts they routed every token to (SGLang's name)
        server_args["return_routed_experts"] = True
    config = SGLangConfig(
        model_path=str(hf_dir),
        urls=tuple(cfg.rollout.urls),
        request_timeout_s=cfg.rollout.timeout_s,
        weight_sync=WeightSyncConfig(method=cfg.rollout.weight_sync, master_address=cfg.rollout.weight_sync_address),
        **server_args,
    )
    if cfg.rollout.colocate:  # servers on the trainer's GPUs, weights as tensor handles (sampling/colocate.py)
        config = replace(config, colocate=True, weight_sync=replace(config.weight_sync, method="tensor"))
    return config


def refuse_colocation(config, trainer_gpus: int) -> None:
    """Servers that rank 0 would launch on GPUs its node's training ranks use (GPUs 0..trainer_gpus-1) are refused:
    the weight-sync group would put a server rank and a trainer rank on one GPU, which NCCL refuses, and SGLang
    sizes its KV cache from the memory free at its start, which training then needs."""
    if config.urls or config.device != "cuda" or config.colocate:  # colocate: shared on purpose (rollout.colocate)
        return
    shared = sorted({gpu for group in config.gpu_groups for gpu in group} & set(range(trainer_gpus)))
    if shared:
        raise ConfigError(
            f"rollout.urls is empty, so rank 0 would launch SGLang servers on GPUs {shared}, which this node's "
            f"{trainer_gpus} training ranks use: colocated rollouts are not supported. Start servers on their own "
            "GPUs or nodes (examples/launch_cluster.sh, ROLE=rollout) and set rollout.urls, or launch them past the "
            f"trainer's GPUs with rollout.server_args.first_gpu={trainer_gpus}")
