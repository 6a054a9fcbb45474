"""The rollout side of a step: the engine (on global rank 0), rewards, and the batch every rank trains on.

Rank 0 owns the rollout engine (SGLang servers or the local engine). It samples G responses per prompt,
scores them and broadcasts the samples and rewards; every rank then builds the same token-aligned batch. With
``rollout.filter_zero_variance_groups`` (DAPO's dynamic sampling) rank 0 drops groups without reward variance and
samples more prompts, for at most ``rollout.max_sampling_rounds`` rounds.
Weight sync is collective: to SGLang servers each pipeline stage's first rank sends its stage, gathered onto it
from its replica's shards, one stage after another; for the local engine (or disk sync) every stage's tensors reach rank 0.
Whenever the other ranks wait for rank 0's work alone (the engine's start, a rollout, an eval, the servers'
side of a weight sync) they wait in the control group (``parallel.control``: gloo, with
``distributed.control_timeout_s``), never in an NCCL collective whose watchdog would abort a long rollout.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.parallel import control
from gspo_megatron.train import elastic
from gspo_megatron.rollout.errors import RolloutError
from gspo_megatron.train import fault_injection
from gspo_megatron.train.config import Config, ConfigError
from gspo_megatron.train.data import Prompt


def make_engine(cfg: Config, hf_dir: str | Path, tokenizer):
    """The configured engine on global rank 0, None elsewhere (collective: the others wait until it is up)."""
    engine = _engine(cfg, hf_dir, tokenizer) if dist.get_rank() == 0 else None
    control.barrier()
    return engine


def _engine(cfg: Config, hf_dir: str | Path, tokenizer):
    from gspo_megatron.rollout import LocalEngine, SGLangConfig, SGLangEngine, WeightSyncConfig

    if cfg.rollout.engine == "local":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
        return LocalEngine(model, tokenizer, seed=cfg.train.seed, version="0",
                           return_routed_experts=cfg.algo.replays_rollout_routing)
    server_args = dict(cfg.rollout.server_args)
    server_args.setdefault("seed", cfg.train.seed)
    for name in ("max_server_restarts", "restart_window_s", "attached_wait_s"):  # fault tolerance
        server_args.setdefault(name, getattr(cfg.rollout, name))
    if cfg.algo.replays_rollout_routing:  # the servers return the experts they routed every token to
        server_args["return_routed_experts"] = True
    config = SGLangConfig(
        model_path=str(hf_dir),
        urls=tuple(cfg.rollout.urls),
        request_timeout_s=cfg.rollout.timeout_s,
        weight_sync=WeightSyncConfig(method=cfg.rollout.weight_sync, master_address=cfg.rollout.weight_sync_address),
        **server_args,
    )
    if cfg.rollout.colocate:  # [colocate hook] servers on the trainer's GPUs, weights as tensor handles
        from dataclasses import replace
        config = replace(config, colocate=True, weight_sync=replace(config.weight_sync, method="tensor"))
    refuse_colocation(config, trainer_gpus=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    # under torchrun --max-restarts: servers kept through a restart of the workers (adopted), or launched to be kept
    servers = None if config.urls else elastic.servers(cfg, config)
    engine = SGLangEngine(config, servers=servers)
    if servers is not None:  # kept servers (torchrun restarts): one relaunched after a failure is recorded anew
        engine.on_relaunch = lambda: elastic.record_servers(cfg, engine.servers)
    return engine


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


@dataclass
class Rollout:
    """One step's rollout, identical on every rank. Samples are prompt-major: G per prompt."""

    samples: list
    rewards: torch.Tensor  # [N] float32
    reward_valid: torch.Tensor  # [N] bool (False: the reward, or the segment reward, failed and was masked)
    batch: dict  # samples_to_batch(...): input_ids, labels, loss_mask, rollout_logprobs [N, S]
    metrics: dict
    segments: list | None = None  # per sample [(end, reward), ...] with algo.token_advantages=segments
    # [N] int64: the trainer's weight version the engine served when the sample's generation started (its first
    # tokens'; under rollout.mode=async a sample in flight across a sync has later tokens from newer versions).
    versions: torch.Tensor | None = None


def _sampling(cfg: Config, step: int, eos_ids, sampling_round: int = 0):
    from gspo_megatron.rollout import SamplingParams

    r = cfg.rollout
    seed = cfg.train.seed * 100_003 + step + 1_000_003 * sampling_round
    stops = tuple(dict.fromkeys(list(eos_ids) + list(r.stop_token_ids)))
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                          stop_token_ids=stops, seed=seed)


def _generate_and_score(engine, prompts: list[Prompt], cfg: Config, step: int, tokenizer, reward_fn, n: int,
                        sampling_round: int = 0):
    """(samples, Rewards, response texts, generation seconds) of n responses per prompt."""
    if cfg.rollout.env:  # multi-turn: the environment's turn rewards instead of reward_fn
        return _trajectories(engine, prompts, cfg, step, tokenizer, n, sampling_round)
    start = time.perf_counter()
    groups = engine.generate([p.ids for p in prompts], n,
                             _sampling(cfg, step, [tokenizer.eos_token_id], sampling_round))
    seconds = time.perf_counter() - start
    samples = [s for g in groups for s in g.samples]
    return (samples, *_score_samples(samples, prompts, cfg, tokenizer, reward_fn), seconds)


def _score_samples(samples, prompts: list[Prompt], cfg: Config, tokenizer, reward_fn) -> tuple:
    """(Rewards, response texts) of samples generated for ``prompts`` (``Sample.prompt_index`` into them)."""
    from gspo_megatron.rollout import score

    labels = [prompts[s.prompt_index].label for s in samples]
    prompt_texts = [prompts[s.prompt_index].text for s in samples]
    responses = [s.text if s.text is not None else tokenizer.decode(s.response_ids, skip_special_tokens=True)
                 for s in samples]
    rewards = score(reward_fn, samples, labels, prompt_texts, responses, on_error=cfg.data.on_reward_error)
    return rewards, responses


_segment_pools: dict = {}  # rank 0's segment-reward workers, per (spec, workers, time limit), kept across steps


def _segment_reward_fn(cfg: Config):
    """``data.segment_reward`` as ``bootstrap.reward_function`` makes it, its worker pool kept across steps."""
    from gspo_megatron.train.bootstrap import reward_function

    d = cfg.data
    key = (d.segment_reward, d.reward_workers, d.reward_timeout_s)
    if key not in _segment_pools:
        _segment_pools[key] = reward_function(cfg, segments=True)
    return _segment_pools[key]


def _trajectories(engine, prompts: list[Prompt], cfg: Config, step: int, tokenizer, n: int,
                  sampling_round: int = 0):
    """n multi-turn trajectories per prompt with rollout.env (``rollout.multiturn``); same results as above."""
    from gspo_megatron.rollout import LocalEngine
    from gspo_megatron.rollout.multiturn import TurnLimits, generate_trajectories, load_env

    r = cfg.rollout
    concurrency = 1 if isinstance(engine, LocalEngine) else r.env_concurrency  # the local engine: one at a time
    limits = TurnLimits(r.max_turns, r.max_trajectory_tokens, concurrency)
    start = time.perf_counter()
    sampling = _sampling(cfg, step, [tokenizer.eos_token_id], sampling_round)
    groups, rewards = generate_trajectories(engine, prompts, n, sampling,
                                            load_env(r.env), tokenizer, limits, cfg.data.on_reward_error, r.env_args)
    samples = [s for g in groups for s in g.samples]
    return samples, rewards, [s.text for s in samples], time.perf_counter() - start


def _segment_rewards(samples, prompts: list[Prompt], cfg: Config, tokenizer):
    """Per-segment rewards (algo.token_advantages=segments): ([(end, reward), ...] per sample, valid [N])."""
    from gspo_megatron.rollout.rewards import score_segments

    fn = _segment_reward_fn(cfg)
    tokens = [[tokenizer.decode([t], skip_special_tokens=True) for t in s.response_ids] for s in samples]
    return score_segments(fn, samples, [prompts[s.prompt_index].label for s in samples],
                          [prompts[s.prompt_index].text for s in samples], tokens, on_error=cfg.data.on_reward_error)


def screen_responses(samples, on_truncated: str) -> tuple[torch.Tensor, dict]:
    """What a step does with degenerate responses -> (kept [N] bool, counts as metrics).

    Cut at max_new_tokens (finish_reason length): trained with its reward (``rollout.on_truncated=keep``), or not
    kept (``mask``: out of the loss and of its group's mean and std, as a failed reward). Empty (no token: an engine
    that stopped before the first): kept, its reward counts in its group's statistics, and it has no token to put
    in the loss (``samples_to_batch`` masks the whole row)."""
    truncated = torch.tensor([s.finish_reason == "length" for s in samples], dtype=torch.bool)
    empty = sum(not s.response_ids for s in samples)
    kept = ~truncated if on_truncated == "mask" else torch.ones_like(truncated)
    return kept, {"responses_truncated": float(truncated.sum()), "responses_empty": float(empty),
                  "truncated_masked": float((~kept).sum())}



def _round(engine, prompts: list[Prompt], cfg: Config, step: int, tokenizer, reward_fn, sampling_round: int) -> dict:
    """One generation round on rank 0: samples, rewards, validity (and segment rewards) of ``prompts``."""
    samples, rewards, responses, seconds = _generate_and_score(
        engine, prompts, cfg, step, tokenizer, reward_fn, cfg.rollout.group_size, sampling_round)
    return _round_data(samples, rewards, responses, seconds, prompts, cfg, tokenizer)


def _round_data(samples, rewards, responses, seconds: float, prompts: list[Prompt], cfg: Config, tokenizer) -> dict:
    """A round's samples and rewards with their validity, segment rewards and response counts."""
    segments, valid = None, rewards.valid
    if cfg.algo.token_advantages == "segments":
        segments, segments_valid = _segment_rewards(samples, prompts, cfg, tokenizer)
        valid = valid & segments_valid
    elif cfg.algo.token_advantages == "turns":  # multi-turn: each turn a segment with its reward
        segments = [s.turns for s in samples]
    kept, response_metrics = screen_responses(samples, cfg.rollout.on_truncated)
    return {"samples": samples, "values": rewards.values, "valid": valid & kept, "segments": segments,
            "seconds": seconds, "responses": responses, "prompts": prompts, "response_metrics": response_metrics,
            "reward_valid": rewards.valid, "reward_timeouts": rewards.timed_out, "reward_crashes": rewards.crashed}


def uniform_groups(values: torch.Tensor, valid: torch.Tensor, group_size: int) -> torch.Tensor:
    """[groups] bool: groups whose valid rewards are all equal (or fewer than two valid): zero advantage."""
    v, ok = values.view(-1, group_size), valid.view(-1, group_size)
    high = torch.where(ok, v, torch.full_like(v, -torch.inf)).amax(dim=1)
    low = torch.where(ok, v, torch.full_like(v, torch.inf)).amin(dim=1)
    return (ok.sum(dim=1) < 2) | (high == low)


def _rounds(engine, prompts: list[Prompt], cfg: Config, step: int, tokenizer, reward_fn, more_prompts) -> tuple:
    """Rank 0's rounds: one, or with rollout.filter_zero_variance_groups (DAPO's dynamic sampling) more prompts
    until ``prompts_per_step`` groups with reward variance are in hand or ``max_sampling_rounds`` rounds ran.
    Returns (the kept groups' round data, all rounds' data, sampling metrics, extra prompts drawn)."""
    r = cfg.rollout
    rounds = [_round(engine, prompts, cfg, step, tokenizer, reward_fn, 0)]
    if not r.filter_zero_variance_groups:
        return rounds[0], rounds, {}, 0
    G, want, extra = r.group_size, r.prompts_per_step, 0
    kept, dropped = [], []  # (round, group) of groups with and without signal
    while True:
        data = rounds[-1]
        uniform = uniform_groups(data["values"], data["valid"], G).tolist()
        kept += [(len(rounds) - 1, g) for g, u in enumerate(uniform) if not u]
        dropped += [(len(rounds) - 1, g) for g, u in enumerate(uniform) if u]
        if len(kept) >= want or len(rounds) == r.max_sampling_rounds or more_prompts is None:
            break
        # Oversample by the rate groups were kept so far (DAPO), at most a full step's prompts.
        keep_rate = max(len(kept), 1) / (len(kept) + len(dropped))
        count = min(want, math.ceil((want - len(kept)) / keep_rate))
        extra += count
        rounds.append(_round(engine, more_prompts(count), cfg, step, tokenizer, reward_fn, len(rounds)))
    chosen = kept[:want] + dropped[:max(0, want - len(kept))]
    chosen.sort()
    metrics = {"sampling/groups_dropped": float(len(dropped)), "sampling/rounds": float(len(rounds)),
               "sampling/prompts": float(want + extra),
               "sampling/uniform_groups_kept": float(max(0, want - len(kept)))}
    picked = {"samples": [], "values": [], "valid": [], "segments": [] if rounds[0]["segments"] is not None else None,
              "responses": [], "prompts": []}
    for i, g in chosen:
        data, rows = rounds[i], slice(g * G, (g + 1) * G)
        picked["samples"] += data["samples"][rows]
        picked["responses"] += data["responses"][rows]
        picked["values"].append(data["values"][rows])
        picked["valid"].append(data["valid"][rows])
        picked["prompts"].append(data["prompts"][g])
        if picked["segments"] is not None:
            picked["segments"] += data["segments"][rows]
    picked["values"], picked["valid"] = torch.cat(picked["values"]), torch.cat(picked["valid"])
    return picked, rounds, metrics, extra


def collect(engine, prompts: list[Prompt], cfg: Config, step: int, tokenizer, reward_fn, pad_multiple: int,
            more_prompts=None, version: int = 0, resync=None, partial=None) -> Rollout:
    """Rank 0 generates and scores, everyone receives: a collective (the others wait in the control group).

    ``more_prompts(count)``: further prompts for rollout.filter_zero_variance_groups (the prompt stream's
    ``next``); every rank calls it for as many prompts as rank 0 drew, so data positions stay equal.
    ``resync()``: the weight sync (collective), for a rollout server restarted without the current weights (they
    came by distributed sync): every rank syncs and rank 0 generates the step again (``on_rank0``).
    ``partial``: rank 0's ``PartialRollouts`` (rollout.partial_chunk_tokens); an attempt generated again starts
    from the groups in flight as the step began (the failed attempt's chunks are dropped)."""
    more = _Redraw(more_prompts) if more_prompts is not None else None
    before = partial.state_dict() if partial is not None else None

    def retry():
        if more is not None:
            more.rewind()
        if partial is not None:
            partial.load_state_dict(before)

    payload = on_rank0(lambda: produce(engine, prompts, cfg, step, tokenizer, reward_fn, more, version, partial),
                       resync, retry=retry)
    return as_rollout(payload, pad_multiple, more_prompts)


def produce(engine, prompts: list[Prompt], cfg: Config, step: int, tokenizer, reward_fn, more_prompts=None,
            version: int = 0, partial=None) -> tuple:
    """Rank 0's side of ``collect``: generate, score, and the payload every rank receives; ``version``: the weights
    the engine serves as generation starts. No collective: the rollout source (``train/rollout_source.py``) runs it
    on a background thread, which talks only to the servers (HTTP) and the reward workers. ``partial``: rank 0's
    ``PartialRollouts`` (``rollout.partial_chunk_tokens``), which draws every prompt through ``more_prompts``."""
    fault_injection.at("rollout", step, engine)  # the soak run's schedule (GSPO_FAULTS); nothing otherwise
    if partial is not None:  # the groups completed this step, some begun in earlier steps under older weights
        sampling = _sampling(cfg, step, [tokenizer.eos_token_id])
        samples, chosen, seconds, extra, sampling_metrics = partial.step(engine, more_prompts, sampling, version)
        rewards, responses = _score_samples(samples, chosen, cfg, tokenizer, reward_fn)
        picked = _round_data(samples, rewards, responses, seconds, chosen, cfg, tokenizer)
        rounds = [picked]
        version = [min(s.token_versions, default=version) for s in samples]  # each sample's oldest token's
    else:
        picked, rounds, sampling_metrics, extra = _rounds(engine, prompts, cfg, step, tokenizer, reward_fn,
                                                          more_prompts)
    if isinstance(more_prompts, _Redraw):  # every prompt rank 0 drew, over all attempts at the step
        extra = len(more_prompts.prompts)
    # Reward statistics over everything sampled (the policy's, not the filtered batch's).
    values = torch.cat([d["values"] for d in rounds])
    valid = torch.cat([d["reward_valid"] for d in rounds])  # truncated responses masked from the loss count here
    lengths = [len(s.response_ids) for d in rounds for s in d["samples"]]
    counts = {k: float(sum(d["response_metrics"][k] for d in rounds)) for k in rounds[0]["response_metrics"]}
    metrics = {
        "reward_mean": float(values[valid].mean()) if valid.any() else float("nan"),
        "reward_masked": float((~picked["valid"]).sum()),
        "reward_timeouts": float(sum(d["reward_timeouts"] for d in rounds)),
        "reward_crashes": float(sum(d["reward_crashes"] for d in rounds)),
        **counts,
        "response_length_mean": sum(lengths) / len(lengths),
        "truncated_frac": counts["responses_truncated"] / len(lengths),
        # Groups whose responses all score the same have zero advantage: no learning signal from them.
        "groups_zero_advantage": float((values.view(-1, cfg.rollout.group_size).std(dim=1) == 0)
                                       .float().mean()),
        "time/rollout": sum(d["seconds"] for d in rounds),
        "example": f"{picked['prompts'][0].text!r} -> {picked['responses'][0]!r}",
        **sampling_metrics,
    }
    if cfg.rollout.env:
        from gspo_megatron.rollout.multiturn import turn_metrics

        metrics.update(turn_metrics([s for d in rounds for s in d["samples"]]))
    metrics.update(engine.fault_metrics() if hasattr(engine, "fault_metrics") else {})
    return picked["samples"], picked["values"], picked["valid"], metrics, picked["segments"], extra, version


def deliver(payload: tuple | None, pad_multiple: int, more_prompts=None) -> Rollout:
    """Rank 0's ``produce`` payload to every rank (collective, in the control group), as the step's Rollout."""
    return as_rollout(control.broadcast_from_rank0(payload), pad_multiple, more_prompts)


def as_rollout(payload: tuple, pad_multiple: int, more_prompts=None) -> Rollout:
    """Every rank's Rollout of rank 0's ``produce`` payload (received)."""
    from gspo_megatron.rollout import samples_to_batch

    samples, values, valid, metrics, segments, extra, version = payload
    if dist.get_rank() != 0 and extra:
        more_prompts(extra)  # rank 0 drew these: keep every rank's data position the same
    batch = samples_to_batch(samples, pad_id=0, pad_to_multiple=pad_multiple)
    versions = torch.tensor(version) if isinstance(version, list) else torch.full((len(samples),), version)
    return Rollout(samples, values, valid, batch, metrics, segments, versions)


class _Redraw:
    """Rank 0's ``more_prompts`` across attempts at a step: an attempt after a resync gets the prompts the earlier
    one drew (in order) before new ones; ``prompts`` holds everything the stream gave."""

    def __init__(self, more_prompts):
        self.more_prompts, self.prompts, self.used = more_prompts, [], 0

    def __call__(self, count: int) -> list:
        if self.used + count > len(self.prompts):
            self.prompts += self.more_prompts(self.used + count - len(self.prompts))
        self.used += count
        return self.prompts[self.used - count:self.used]

    def rewind(self) -> None:
        self.used = 0


def on_rank0(work, resync=None, retry=None):
    """``work()`` on rank 0, its result on every rank (collective). If a rollout server was restarted without the
    current weights (``StaleWeights``: they came by distributed sync), every rank calls ``resync()`` and rank 0
    works again (after ``retry()``); without ``resync`` the error is raised."""
    from gspo_megatron.rollout import StaleWeights

    while True:
        payload = None
        if dist.get_rank() == 0:
            try:
                payload = ("done", work())
            except StaleWeights as e:
                if resync is None:
                    raise
                print(f"{e}: syncing the weights again, then generating again", flush=True)
                payload = ("resync", None)
        kind, result = control.broadcast_from_rank0(payload)
        if kind == "done":
            return result
        resync()
        if retry is not None:
            retry()


def evaluate(engine, prompts: list[Prompt], cfg: Config, step: int, tokenizer, reward_fn, resync=None) -> dict:
    """Mean reward of one response per held-out prompt (rank 0; others get the numbers by broadcast).
    ``resync``: as ``collect``'s."""
    return on_rank0(lambda: eval_metrics(engine, prompts, cfg, step, tokenizer, reward_fn), resync)


def eval_metrics(engine, prompts: list[Prompt], cfg: Config, step: int, tokenizer, reward_fn) -> dict:
    """Rank 0's side of ``evaluate`` (no collective)."""
    _, rewards, _, seconds = _generate_and_score(engine, prompts, cfg, -step, tokenizer, reward_fn, 1)
    return {"eval_reward_mean": float(rewards.values[rewards.valid].mean()), "time/eval": seconds}


def pipeline_gathered(bridge, model):
    """The bridge's export, with every pipeline stage's tensors delivered to the first stage (collective).

    Stage by stage: the stage's tensor names travel first (a small object broadcast over the PP group), then
    each tensor as the stage exports it. First-stage ranks yield all of them, in stage order; other stages
    yield nothing. Peak extra memory is one tensor.
    """
    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    pp_size, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    if pp_size == 1:
        yield from bridge.export_hf_weights(model)
        return
    shapes = bridge.hf_tensor_shapes()
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    for stage in range(pp_size):
        src = dist.get_global_rank(pp_group, stage)
        names = [bridge.export_names(model) if pp_rank == stage else None]
        dist.broadcast_object_list(names, src=src, group=pp_group)
        if pp_rank == stage:
            for name, tensor in bridge.export_hf_weights(model):
                if stage != 0:
                    dist.broadcast(tensor.contiguous(), src=src, group=pp_group)
                else:
                    yield name, tensor
        elif stage != 0:  # the first stage's tensors stay where they are
            for name in names[0]:
                received = torch.empty(shapes[name], dtype=dtype, device=device)
                dist.broadcast(received, src=src, group=pp_group)
                if pp_rank == 0:
                    yield name, received


def sync_weights(policy, engine, version: int) -> dict:
    """Send the policy's weights to the engine as ``version`` (collective over all ranks).

    To SGLang servers by distributed broadcast: one sender per pipeline stage (its first rank:
    ``Bridge.export_to_sender``), each in its own group with the servers, the stages one after another (every server
    then receives the buckets in the same order); only the ranks holding shards of a sender's
    replica gather (to it), the other data-parallel replicas wait. Rank 0 opens the update before any sender sends
    and closes it after the last, then checks the served version. Otherwise (the local engine, disk sync) every
    stage's tensors reach rank 0 (``pipeline_gathered``), which hands them to the engine. The ranks wait for rank
    0's solo work in the control group; inside the export they wait in gathers while their sender sends one bucket
    (``distributed.timeout_s``)."""
    from gspo_megatron.train.performance import params_current

    start = time.perf_counter()
    params_current(policy.model)  # under overlap_param_gather the last step's all-gather is still to come
    while True:
        target = control.broadcast_from_rank0(_stage_sync_target(engine) if dist.get_rank() == 0 else None)
        if target is None:
            metrics = _sync_through_rank0(policy, engine, version)
        else:
            metrics = _sync_from_stage_senders(policy, engine, version, target)
        if metrics is not None:
            break
        # A server died inside the update: restarted (rank 0), every rank sends the whole update again.
    metrics["time/weight_sync"] = time.perf_counter() - start
    return metrics


def _stage_sync_target(engine):
    """The servers' ``SyncTarget`` when the engine takes distributed updates from several senders, else None."""
    from gspo_megatron.rollout import SGLangEngine

    if isinstance(engine, SGLangEngine) and engine.config.weight_sync.method == "distributed":
        return engine.sync_target()
    return None


_stage_senders: dict = {}  # this process's sender (its group with the servers), per servers' target


def _stage_sender(target):
    from gspo_megatron import environment

    key = (target.urls, target.backend, target.epoch)
    sender = _stage_senders.get(key)
    if sender is not None and sender.broken:
        sender.close()
        sender = None
    if sender is None:
        for stale in [k for k in _stage_senders if k[:2] == key[:2] and k != key]:  # servers restarted since
            _stage_senders.pop(stale).close()
        sender = _stage_senders[key] = target.connect(environment.device(), tag=f"_r{dist.get_rank()}")
    return sender


def _sync_from_stage_senders(policy, engine, version, target) -> dict | None:
    """The distributed update from every stage's sender; None when a server died inside it and rank 0 restarted
    the servers (then every rank sends it again). A sender that fails goes on walking the export (its gathers run
    in step on every rank of its replica) and reports the failure to every rank."""
    from gspo_megatron.model.bridge import is_stage_sender
    from gspo_megatron.rollout import SyncStats
    from gspo_megatron.rollout.weight_sync import consume

    from megatron.core import parallel_state as ps

    rank0 = dist.get_rank() == 0
    start = time.perf_counter()
    sender, problem = None, None
    try:
        if rank0:
            assert is_stage_sender(), "global rank 0 must be the first pipeline stage's sender"
            sender = engine.begin_distributed_update(str(version))
            if isinstance(version, int):
                fault_injection.at("weight_sync", version, engine)  # the soak run's schedule (GSPO_FAULTS)
        elif is_stage_sender():
            sender = _stage_sender(target)  # formed with the servers on first use (rank 0 opens the update meanwhile)
    except (RolloutError, RuntimeError, OSError) as e:  # a server gone: its group or its update cannot start
        problem = f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
    control.barrier()  # the update is open on every server before any sender sends
    begun = time.perf_counter()
    sent = None
    # Stage by stage, so that every server receives the buckets in one order: a server takes one update call at a
    # time and broadcasts on that call's group, so two stages sending at once could be taken in opposite orders by
    # two servers, each then waiting in one stage's broadcast for the other (until weight_sync.timeout_s).
    stages, my_stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    failed = False  # some rank failed in an earlier stage: the update is sent again anyway, later stages skip it
    for stage in range(stages):
        if stage == my_stage:
            exported = policy.bridge.export_to_sender(policy.model)
            if sender is not None and problem is None and not failed:
                try:
                    stats = sender.send_buckets(exported, target.config)
                    sent = (stats.seconds, stats.num_tensors, stats.num_bytes, stats.num_buckets, stats.phases)
                except (RolloutError, RuntimeError, OSError) as e:
                    problem = f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
            consume(exported)  # this rank's shards go to its sender (or, in another replica, nothing to do);
            # after a failed (or skipped) send, the rest of the export, in step with the replica's other ranks
        if stage + 1 < stages:  # the next stage starts when this one is done
            failed = any(control.all_gather(problem is not None))
    reports = control.all_gather((sent, problem))
    parts = [p for p, _ in reports if p is not None]
    problems = [q for _, q in reports if q is not None]
    metrics = {}
    if rank0 and not problems:
        # Phases of the slowest sender (the one the update waited for), and the whole update's bytes and time.
        slowest = max(parts, key=lambda p: p[0])
        phases = {"begin": begun - start, "send": time.perf_counter() - begun, **slowest[4]}
        t = time.perf_counter()
        totals = (sum(p[1] for p in parts), sum(p[2] for p in parts), sum(p[3] for p in parts))
        try:
            engine.end_distributed_update(str(version), SyncStats("distributed", str(version), t - start, *totals,
                                                                  phases))
        except (RolloutError, RuntimeError, OSError) as e:
            problems.append(f"rank 0 ending the update: {type(e).__name__}: {e}")
        phases["end"] = time.perf_counter() - t
        stats = SyncStats("distributed", str(version), time.perf_counter() - start, *totals, phases)
        metrics = {f"weight_sync/{k.split('/')[-1]}": v for k, v in stats.metrics().items()}
        metrics["weight_sync/senders"] = float(len(parts))
    outcome = None
    if rank0:
        outcome = "ok"
        if problems:
            try:
                engine.recover_failed_update("; ".join(problems))
                outcome = "again"
            except RolloutError as e:
                outcome = e
    outcome = control.broadcast_from_rank0(outcome)
    if isinstance(outcome, Exception):
        raise outcome
    return metrics if outcome == "ok" else None


def _sync_through_rank0(policy, engine, version) -> dict:
    """Every stage's tensors to rank 0, which gives them to the engine (the local engine, disk sync)."""
    tensors = _after_control_barrier(pipeline_gathered(policy.bridge, policy.model))
    if dist.get_rank() == 0:
        stats = engine.update_weights(tensors, str(version))  # pulls the first tensor once the servers are ready
        metrics = {f"weight_sync/{k.split('/')[-1]}": v for k, v in stats.metrics().items()}
    else:
        for _ in tensors:  # the export gathers over TP/EP (and PP): every rank walks it in step
            pass
        metrics = {}
    control.barrier()
    return metrics


def _after_control_barrier(tensors):
    """``tensors``, once every rank has reached the control barrier (rank 0 reaches it when the engine asks for
    the first tensor, after its own set-up)."""
    control.barrier()
    yield from tensors
