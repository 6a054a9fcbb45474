"""Rank function of test_routing_replay (module level: ``run_on_ranks`` spawns it).

Every rank builds the Megatron policy (routers built for replay) through the bridge from the HF directory the
server serves; rank 0 attaches an SGLangEngine asking for routed experts and broadcasts its samples (single-turn, or
multi-turn trajectories whose routes were assembled from each turn's call). Then, on one
micro batch of all of them, three forwards of ``logprob_pass``: the server's routes replayed (R3), the same routes
shifted by one position (replay that is misaligned), and free routing. Hooks on every router record the experts it
actually used (its routing map), compared here with the server's routes for the same tokens, worked out
independently of ``train.update.routing.rank_routing``: under sequence parallelism TP rank r's routers see positions
[r * S / tp, (r + 1) * S / tp) of every row, s-major.
"""

from __future__ import annotations

import torch

N_PROMPTS, GROUP, NEW_TOKENS = 4, 4, 10


def _server_multi_hot(samples, S: int, layer: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, E] bool: the server's experts of ``layer`` for every position it routed, and [B, S] which those are."""
    hot = torch.zeros(len(samples), S, experts, dtype=torch.bool)
    routed = torch.zeros(len(samples), S, dtype=torch.bool)
    for b, s in enumerate(samples):
        t = s.rollout_routing.shape[0]
        hot[b, :t].scatter_(1, s.rollout_routing[:, layer].long(), True)
        routed[b, :t] = True
    return hot, routed


def _generate(engine, multiturn: bool) -> list:
    """Single-turn samples, or 3-turn trajectories of ``ScriptedEnv`` (text and token-id observations)."""
    from types import SimpleNamespace

    from gspo_megatron.rewards import synthetic
    from gspo_megatron.rewards.multiturn import TurnLimits, generate_trajectories
    from gspo_megatron.rollout import SamplingParams, flatten
    from tests.rewards.user_envs import ScriptedEnv

    from .helpers import prompts

    if not multiturn:
        return flatten(engine.generate(prompts(N_PROMPTS, seed=30), n=GROUP,
                                       sampling=SamplingParams(max_new_tokens=NEW_TOKENS)))
    records = [SimpleNamespace(ids=p, text="", label=None) for p in prompts(N_PROMPTS, seed=31)]
    groups, _ = generate_trajectories(engine, records, GROUP, SamplingParams(max_new_tokens=4, seed=11,
                                                                             ignore_eos=True),
                                      ScriptedEnv, synthetic.char_tokenizer(), TurnLimits(3, 64, concurrency=8))
    return flatten(groups)


def r3_replay(model_dir: str, server_url: str, layout, multiturn: bool = False) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.moe.router import TopKRouter

    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.provider import build_gpt_model
    from gspo_megatron.rollout import SGLangConfig, SGLangEngine, logprob_mismatch, samples_to_batch
    from gspo_megatron.train.update.schedules import logprob_pass

    spec = read_hf_config(model_dir)
    model = build_gpt_model(spec, layout, calculate_per_token_loss=True, moe_enable_routing_replay=True)
    Bridge(spec).load_hf_weights(model, model_dir)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    out: dict = {}
    samples = None
    if torch.distributed.get_rank() == 0:
        config = SGLangConfig(urls=(server_url,), model_path=model_dir, device="cpu", request_timeout_s=120,
                              return_routed_experts=True)
        with SGLangEngine(config) as engine:
            samples = _generate(engine, multiturn)
        out["shapes"] = [(len(s.prompt_ids), len(s.response_ids), tuple(s.rollout_routing.shape)) for s in samples]
        out["distinct"] = all(len(set(row.tolist())) == len(row)
                              for s in samples for row in s.rollout_routing.flatten(0, 1))
    box = [samples]
    torch.distributed.broadcast_object_list(box, src=0)
    samples = box[0]
    batch = samples_to_batch(samples, pad_to_multiple=layout.tensor, min_length=16)
    B, S = batch["input_ids"].shape

    routers = [m for m in ddp.modules() if isinstance(m, TopKRouter)]
    used: dict[int, torch.Tensor] = {}

    def hook(router):
        def record(_module, _inputs, output):
            used[router.layer_number - 1] = output[1].detach().clone()  # routing map [s_local * b, E]
        return record

    handles = [r.register_forward_hook(hook(r)) for r in routers]
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    s_local = S // tp if layout.sequence_parallel else S
    start = tp_rank * s_local if layout.sequence_parallel else 0

    def agreement() -> tuple[int, int]:
        """(tokens x layers routed exactly as the server did, out of how many it routed) on this rank."""
        same = total = 0
        for layer, routing_map in used.items():
            chosen = routing_map.view(s_local, B, -1).transpose(0, 1)  # [b, s_local, E]
            hot, routed = _server_multi_hot(samples, S, layer, chosen.shape[-1])
            hot, routed = hot[:, start:start + s_local], routed[:, start:start + s_local]
            same += int(((chosen == hot).all(dim=-1) & routed).sum())
            total += int(routed.sum())
        return same, total

    micro = {k: batch[k] for k in ("input_ids", "labels", "loss_mask", "rollout_routing")}
    shifted = dict(micro, rollout_routing=batch["rollout_routing"].roll(1, dims=1))
    free = {k: batch[k] for k in ("input_ids", "labels", "loss_mask")}
    for name, mb in (("r3", micro), ("shifted", shifted), ("free", free)):
        used.clear()
        logprobs = logprob_pass(ddp, [mb])["logprobs"].cpu()
        out[name] = logprob_mismatch(logprobs, batch["rollout_logprobs"], batch["loss_mask"])
        out[name]["routes_same"], out[name]["routes_total"] = agreement()
        out[name]["layers_seen"] = sorted(used)
    for h in handles:
        h.remove()
    return out
