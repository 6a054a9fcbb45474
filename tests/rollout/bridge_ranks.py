"""Rank functions for test_bridge_sync (module level: ``run_on_ranks`` spawns them).

Each rank builds the Megatron policy through the bridge from an HF directory (what the server serves), and
rank 0 attaches an SGLangEngine to the server. Rank 0's rollouts are broadcast to every rank, each data-parallel
rank scores its share with ``logprob_pass`` (the fused op inside Megatron's schedule), then one GSPO
``update_step``, a distributed weight sync from ``Bridge.export_hf_weights`` (every rank iterates it: it
all-gathers the experts over EP; rank 0 sends), and the same comparison on a fresh rollout; then the same for a ``LocalEngine`` fed the export.
``stage_senders_sync``: the trainer's own sync (``train.weight_sync.sync.sync_weights``: one sender per pipeline stage, each
gathering its stage from the ranks that hold its shards) from the loop's policy under PP=2 x EP=2.
"""

from __future__ import annotations

import torch

N_PROMPTS, GROUP = 4, 4


def _rollout(engine, seed):
    from gspo_megatron.rollout import SamplingParams, flatten, samples_to_batch

    from .helpers import prompts

    samples = None
    if engine is not None:
        samples = flatten(engine.generate(prompts(N_PROMPTS, seed=seed), n=GROUP,
                                          sampling=SamplingParams(max_new_tokens=10)))
    box = [samples]
    torch.distributed.broadcast_object_list(box, src=0)
    samples = box[0]
    return samples, samples_to_batch(samples, min_length=16)


def _my_share(batch: dict) -> dict:
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = next(iter(batch.values())).shape[0] // dp
    return {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}


def _mismatch(model, share):
    from gspo_megatron.rollout import logprob_mismatch
    from gspo_megatron.train.update.schedules import logprob_pass

    mb = {k: share[k] for k in ("input_ids", "labels", "loss_mask")}
    ours = logprob_pass(model, [mb])["logprobs"]
    return logprob_mismatch(ours, share["rollout_logprobs"], share["loss_mask"]), ours


def bridge_sync(model_dir: str, server_url: str, version: str) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from gspo_megatron.algo import group_advantages
    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.provider import build_gpt_model
    from gspo_megatron.parallel.groups import Layout
    from gspo_megatron.rollout import SGLangConfig, SGLangEngine
    from gspo_megatron.rollout.weight_sync import consume
    from gspo_megatron.train.update.loss import LossConfig
    from gspo_megatron.train.update.schedules import update_step

    rank = torch.distributed.get_rank()
    spec = read_hf_config(model_dir)
    bridge = Bridge(spec)
    model = build_gpt_model(spec, Layout(expert=torch.distributed.get_world_size()), calculate_per_token_loss=True)
    bridge.load_hf_weights(model, model_dir)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=2e-2, weight_decay=0.0), [ddp])
    engine = None
    if rank == 0:
        engine = SGLangEngine(SGLangConfig(urls=(server_url,), device="cpu", request_timeout_s=120))
    out = {}
    try:
        samples, batch = _rollout(engine, seed=20)
        share = _my_share(batch)
        out["before"], old = _mismatch(ddp, share)
        rewards = torch.rand(len(samples), generator=torch.Generator().manual_seed(0))
        advantages = group_advantages(rewards, GROUP)
        share_adv = _my_share({"a": advantages})["a"]
        micro = {k: share[k] for k in ("input_ids", "labels", "loss_mask")}
        # Old log-probs from the rollout (GSPO tolerates the engine's); wide clip so the step moves the weights.
        micro.update(old_logprobs=share["rollout_logprobs"], advantages=share_adv)
        step = update_step(ddp, optimizer, [micro], LossConfig(eps_low=0.2, eps_high=0.2))
        out["update_successful"] = step["update_successful"]
        out["stale"], _ = _mismatch(ddp, share)  # new weights vs the old rollout
        exported = bridge.export_hf_weights(model)
        if engine is not None:
            stats = engine.update_weights(exported, version)
            out["sync"] = {"seconds": stats.seconds, "tensors": stats.num_tensors, "version": engine.weight_version()}
        else:
            consume(exported)
        samples, batch = _rollout(engine, seed=21)
        out["versions"] = sorted({s.weight_version for s in samples})
        out["after"], _ = _mismatch(ddp, _my_share(batch))
        # The local engine fed through the bridge: rank 0's transformers model gets the export too.
        local = None
        if rank == 0:
            from transformers import AutoModelForCausalLM

            from gspo_megatron.rollout import LocalEngine

            local = LocalEngine(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), seed=1)
            local.update_weights(bridge.export_hf_weights(model), version + "-local")
        else:
            consume(bridge.export_hf_weights(model))
        samples, batch = _rollout(local, seed=22)
        out["local_versions"] = sorted({s.weight_version for s in samples})
        out["local"], _ = _mismatch(ddp, _my_share(batch))
    finally:
        if engine is not None:
            engine.close()
    return out


def stage_senders_sync(model_dir: str, server_url: str | list[str], version: str, sync: dict | None = None) -> dict:
    """The loop's policy (``build_policy``) under this launch's layout: log-probs against SGLang's before, after
    the weights move (stale) and after ``train.weight_sync.sync.sync_weights``; rank 0 returns the sync's metrics.
    ``server_url``: one server or several; ``sync``: ``WeightSyncConfig`` fields."""
    from gspo_megatron.rollout import WeightSyncConfig
    import zlib

    from gspo_megatron.rollout import SGLangConfig, SGLangEngine
    from gspo_megatron.train.weight_sync import sync as weight_sync
    from gspo_megatron.train.startup.config import load_config
    from gspo_megatron.train.startup.policy import build_policy

    from megatron.core import parallel_state as ps

    rank = torch.distributed.get_rank()
    cfg = load_config(None, ["data.task=reverse", f"model.hf_dir={model_dir}", "parallel.distributed_optimizer=false",
                             f"parallel.pipeline={ps.get_pipeline_model_parallel_world_size()}",
                             f"parallel.expert={ps.get_expert_model_parallel_world_size()}"])
    policy = build_policy(cfg, model_dir)
    urls = (server_url,) if isinstance(server_url, str) else tuple(server_url)
    config = SGLangConfig(urls=urls, device="cpu", request_timeout_s=120, weight_sync=WeightSyncConfig(**(sync or {})),
                          prompts_per_request=8 if len(urls) == 1 else 1)  # several servers: each gets prompts
    engine = SGLangEngine(config) if rank == 0 else None
    out = {}
    try:
        _, batch = _rollout(engine, seed=30)
        out["before"], _ = _mismatch(policy.model, _my_share(batch))
        # New weights, the same on data-parallel replicas: each parameter scaled by noise seeded by its local name.
        with torch.no_grad():
            for name, param in policy.model.named_parameters():
                noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
                param.mul_(1 + 0.2 * noise)
        out["stale"], _ = _mismatch(policy.model, _my_share(batch))
        out["sync"] = weight_sync.sync_weights(policy, engine, version)
        samples, batch = _rollout(engine, seed=31)
        out["versions"] = sorted({s.weight_version for s in samples})
        out["after"], _ = _mismatch(policy.model, _my_share(batch))
    finally:
        if engine is not None:
            engine.close()
    return out
