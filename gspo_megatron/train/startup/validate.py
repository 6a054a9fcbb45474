"""Every config rule that can be checked before a process starts; errors name the field and the fix."""

from __future__ import annotations

import math

from gspo_megatron.algo import AGGREGATIONS, KL_ESTIMATORS
from gspo_megatron.environment import transformer_engine_available
from gspo_megatron.model.hf_config import FAMILIES
from gspo_megatron.parallel.groups import Layout
from gspo_megatron.train.startup.config import Config, ConfigError, correction, unknown_names
from gspo_megatron.algo.defaults import ALGORITHMS
from gspo_megatron.train.startup.performance import check_performance
from gspo_megatron.train.update.recompute import check_recompute

ENGINES = ("sglang", "local")
WEIGHT_SYNCS = ("distributed", "disk")
TOKEN_ADVANTAGES = ("sequence", "segments", "turns")
LR_DECAYS = ("constant", "linear", "cosine")


def _one_of(value, allowed, name):
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of {allowed}")


def _divides(n: int, d: int, n_name: str, d_name: str, fix: str = "") -> None:
    if d <= 0 or n % d:
        raise ConfigError(f"{n_name}={n} is not divisible by {d_name}={d}" + (f": {fix}" if fix else ""))


def _positive(value, name):
    if value <= 0:
        raise ConfigError(f"{name}={value} must be > 0")


def validate_layout(cfg: Config, world_size: int) -> int:
    """Parallel sizes against the world size; returns the data-parallel size."""
    p = cfg.parallel
    for name in ("tensor", "pipeline", "expert", "context", "micro_batch_size"):
        _positive(getattr(p, name), f"parallel.{name}")
    model_parallel = p.tensor * p.pipeline * p.context
    _divides(world_size, model_parallel, "world size", "parallel.tensor*pipeline*context",
             "launch a multiple of that many processes, or lower the parallel sizes")
    etp = p.expert_tensor or p.tensor
    _divides(world_size, p.expert * etp * p.pipeline, "world size", "parallel.expert*expert_tensor*pipeline")
    if p.max_tokens_per_micro_batch is not None:
        _positive(p.max_tokens_per_micro_batch, "parallel.max_tokens_per_micro_batch")
        if not p.pack_sequences:
            raise ConfigError("parallel.max_tokens_per_micro_batch needs parallel.pack_sequences=true (the budget "
                              "counts the tokens of a packed row; padded rows would cost their padding too)")
    if p.context > 1:
        if not transformer_engine_available():
            raise ConfigError(
                f"parallel.context={p.context} needs TransformerEngine attention (megatron's local attention "
                "cannot split sequences); install the gpu extra or set parallel.context=1"
            )
        if cfg.algo.name != "gspo":
            raise ConfigError(f"parallel.context={p.context} supports algo.name='gspo' only, got {cfg.algo.name!r}")
    return world_size // model_parallel


def validate_model(cfg: Config, hf: dict) -> None:
    """The model against the layout (the model provider repeats these with megatron's own config)."""
    p = cfg.parallel
    heads = hf.get("num_attention_heads")
    kv = hf.get("num_key_value_heads", heads)
    if heads:
        _divides(heads, p.tensor, "num_attention_heads", "parallel.tensor")
        _divides(kv, p.tensor, "num_key_value_heads", "parallel.tensor",
                 "megatron splits whole key/value groups over TP ranks")
    key = next((k for k in ("num_experts", "num_local_experts", "n_routed_experts") if hf.get(k)), None)
    experts = hf[key] if key else 0  # n_routed_experts: DeepSeek-V3, Kimi-K2, GLM-4.5
    if experts:
        _divides(experts, p.expert, key, "parallel.expert")
        if p.tensor > 1 and not p.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel=false with parallel.tensor>1: MoE layers need sequence "
                              "parallelism under TP; set parallel.sequence_parallel=true")
    elif p.expert > 1:
        raise ConfigError(f"parallel.expert={p.expert} but the model has no experts; set parallel.expert=1")
    if cfg.algo.routing_replay and not experts:
        raise ConfigError(f"algo.routing_replay={cfg.algo.routing_replay} replays MoE routing but the "
                          "model has no experts; set algo.routing_replay=false")
    if hf.get("num_hidden_layers"):
        problem = Layout.of(p).stage_split_problem(hf["num_hidden_layers"], (
            "num_hidden_layers", "parallel.pipeline", "parallel.first_stage_layers", "parallel.last_stage_layers"))
        if problem:
            raise ConfigError(problem)
    if p.context > 1:
        from gspo_megatron.model.hf_config import family_of, text_config

        family = family_of(text_config(hf))
        if family.gated_deltanet:  # model.layout_check repeats this: 0.16.1's DeltaNet has no CP, 0.19.2's is untested
            raise ConfigError(f"parallel.context={p.context}: {family.model_type}'s gated-DeltaNet (linear-attention) "
                              "layers are not supported under context parallelism here; set parallel.context=1")
    if cfg.model.grouped_gemm and not transformer_engine_available():
        raise ConfigError("model.grouped_gemm=true needs TransformerEngine (megatron's TEGroupedMLP): install the gpu "
                          "extra, or set model.grouped_gemm=null (grouped where TE imports) or false")
    if cfg.model.mla_down_proj_fusion:
        from gspo_megatron.model.hf_config import read_hf_config
        from gspo_megatron.model.mla import down_proj_fusion_problem

        problem = down_proj_fusion_problem(read_hf_config(hf))
        if problem:
            raise ConfigError(problem)


def validate_megatron(hf: dict | None) -> None:
    """What the installed megatron-core must build for this model (``train``, not ``plan``: a plan is for the cluster's
    megatron-core): GLM-5 / DeepSeek-V3.2's sparse attention needs 0.19.2's."""
    if hf is not None and getattr(FAMILIES.get(hf.get("model_type")), "dsa", False):
        from gspo_megatron.model.dsa import megatron_problem
        from gspo_megatron.model.hf_config import read_hf_config

        problem = megatron_problem(read_hf_config(hf))
        if problem:
            raise ConfigError(problem)


def validate_optimizer(cfg: Config) -> None:
    """The optimizer's host offload and the gradient buffer's dtype (``optimizer.offload_fraction``,
    ``optimizer.grad_reduce_in_fp32``): what megatron's HybridDeviceOptimizer runs correctly."""
    o = cfg.optimizer
    if not 0 <= o.offload_fraction <= 1:
        raise ConfigError(f"optimizer.offload_fraction={o.offload_fraction:g} must be in [0, 1] (0: off, 1: the whole "
                          "optimizer state in host memory)")
    if not o.grad_reduce_in_fp32 and cfg.model.dtype != "bfloat16":
        raise ConfigError(f"optimizer.grad_reduce_in_fp32=false with model.dtype={cfg.model.dtype}: the gradient "
                          "buffer takes the parameters' dtype, fp32 either way; set optimizer.grad_reduce_in_fp32=true")
    if not o.offload_fraction:
        return
    if not cfg.parallel.distributed_optimizer:
        raise ConfigError(f"optimizer.offload_fraction={o.offload_fraction:g} needs parallel.distributed_optimizer=true "
                          "(megatron offloads under its precision-aware optimizer, which shards the state "
                          "over data-parallel ranks)")
    if o.offload_fraction < 1 and cfg.model.dtype != "bfloat16":
        # HybridDeviceOptimizer hands a kept fp32 parameter no gradient: it reads .grad, the distributed optimizer
        # sets .decoupled_grad, and only bf16 parameters (given fp32 copies) or offloaded ones get theirs copied.
        raise ConfigError(f"optimizer.offload_fraction={o.offload_fraction:g} with model.dtype={cfg.model.dtype}: "
                          "megatron's HybridDeviceOptimizer would not update the fp32 parameters kept on the GPU; "
                          "set optimizer.offload_fraction=1 or model.dtype=bfloat16")
    if cfg.rollout.colocate_offload != "none":
        raise ConfigError(f"optimizer.offload_fraction={o.offload_fraction:g} with rollout.colocate_offload="
                          f"{cfg.rollout.colocate_offload}: the optimizer state is offloaded once already; set "
                          "rollout.colocate_offload=none (or optimizer.offload_fraction=0)")


def validate_machine(cfg: Config) -> None:
    """What this machine must have for ``train`` (not ``plan``, which sizes the cluster from anywhere): the
    optimizer's host offload runs on CUDA streams only."""
    import torch

    if cfg.optimizer.offload_fraction and not torch.cuda.is_available():
        raise ConfigError(f"optimizer.offload_fraction={cfg.optimizer.offload_fraction:g} needs CUDA (megatron's "
                          "HybridDeviceOptimizer copies gradients and weights over CUDA streams) and this machine "
                          "has none: set optimizer.offload_fraction=0 (on the CPU the state is in host memory "
                          "anyway)")


def validate_timeouts(cfg: Config) -> None:
    """Each wait must end with the error that explains it: the limits of rank 0's own work (a rollout, a weight-sync
    call) are shorter than the collective timeouts of the ranks waiting for it."""
    from gspo_megatron.rollout.config import SGLangConfig, WeightSyncConfig

    d = cfg.distributed
    for name in ("timeout_s", "control_timeout_s"):
        value = getattr(d, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"distributed.{name}={value:g} must be a positive number of seconds")
    if d.timeout_s <= WeightSyncConfig.timeout_s:
        raise ConfigError(f"distributed.timeout_s={d.timeout_s:g} must exceed the weight sync's limit per call "
                          f"({WeightSyncConfig.timeout_s:g} s): the other ranks wait in the export's collectives "
                          "while rank 0 sends a bucket")
    if cfg.rollout.engine == "sglang":
        limit = cfg.rollout.server_args.get("rollout_timeout_s", SGLangConfig.rollout_timeout_s)
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise ConfigError(f"rollout.server_args.rollout_timeout_s={limit!r} must be a number of seconds")
        if d.control_timeout_s <= limit:
            raise ConfigError(f"distributed.control_timeout_s={d.control_timeout_s:g} must exceed the rollout's "
                              f"limit (rollout.server_args.rollout_timeout_s={limit:g}): the other ranks wait that "
                              "long for rank 0's rollout; raise distributed.control_timeout_s")


# SGLangConfig fields the trainer sets from other sections (rollout.urls, rollout.timeout_s, rollout.weight_sync, ...)
TRAINER_SET_SERVER_FIELDS = ("model_path", "urls", "request_timeout_s", "weight_sync")
SGLANG_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # sglang.launch_server --dtype


def validate_server_args(cfg: Config) -> None:
    """``rollout.server_args`` keys against ``SGLangConfig``'s fields (SGLang's own flags go in its ``extra_args``)."""
    import dataclasses

    from gspo_megatron.rollout.config import SGLangConfig

    known = [f.name for f in dataclasses.fields(SGLangConfig) if f.name not in TRAINER_SET_SERVER_FIELDS]
    unknown = [k for k in cfg.rollout.server_args if k not in known]
    if unknown:
        set_elsewhere = [k for k in unknown if k in TRAINER_SET_SERVER_FIELDS]
        raise ConfigError(
            (f"rollout.server_args: {set_elsewhere} come from other fields (rollout.urls, rollout.timeout_s, "
             "rollout.weight_sync, model.hf_dir)" if set_elsewhere else unknown_names(
                 unknown, known, "rollout.server_args: unknown key(s)"))
            + "; SGLang's own command-line flags go in rollout.server_args.extra_args: ['--flag', 'value']")
    dtype = cfg.rollout.server_args.get("dtype")
    if dtype is not None and dtype not in SGLANG_DTYPES:
        raise ConfigError(unknown_names([dtype], SGLANG_DTYPES, "rollout.server_args.dtype: unknown dtype").replace(
            "known:", "one of:"))
    extra = cfg.rollout.server_args.get("extra_args") or ()
    if extra and cfg.rollout.engine == "sglang" and not cfg.rollout.urls:
        check_sglang_flags(list(extra))


def check_sglang_flags(args: list[str]) -> None:
    """``rollout.server_args.extra_args`` against ``sglang.launch_server``'s own parser (where SGLang imports)."""
    import argparse
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    _, unknown = parser.parse_known_args(["--model-path", "-", *map(str, args)])
    flags = [a.split("=")[0] for a in unknown if a.startswith("-")]
    if flags:
        raise ConfigError(unknown_names(flags, [o for o in parser._option_string_actions if o.startswith("--")],
                                        "rollout.server_args.extra_args: not flags of sglang.launch_server").split(
                                            "; known:")[0])


def validate_env(cfg: Config) -> None:
    """Multi-turn rollouts (rollout.env) and turn-level advantages."""
    a, r = cfg.algo, cfg.rollout
    if not (0 < a.gamma <= 1):
        raise ConfigError(f"algo.gamma={a.gamma} must be in (0, 1]")
    if a.token_advantages == "turns":
        if not r.env:
            raise ConfigError("algo.token_advantages='turns' needs rollout.env (the environment's per-turn rewards)")
        if a.name == "gspo":
            raise ConfigError("algo.token_advantages='turns' needs a loss with per-token advantages: set "
                              "algo.name=gspo_token (or grpo)")
    elif a.gamma != 1:
        raise ConfigError(f"algo.gamma={a.gamma} applies to algo.token_advantages='turns' only")
    if not r.env:
        return
    from gspo_megatron.rewards.multiturn import BUILTIN_ENVS, load_env

    try:
        env_class = load_env(r.env)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(r.env_args, dict):
        raise ConfigError(f"rollout.env_args={r.env_args!r} must be a mapping of keyword arguments")
    if r.env in BUILTIN_ENVS:  # cheap to build: check env_args now, not in the first rollout (a user class may not be)
        try:
            env_class(**r.env_args)
        except TypeError as e:
            raise ConfigError(f"rollout.env_args={r.env_args!r} for rollout.env={r.env}: {e}") from None
        except ValueError as e:
            raise ConfigError(str(e)) from None
    for name in ("max_turns", "max_trajectory_tokens", "env_concurrency"):
        _positive(getattr(r, name), f"rollout.{name}")


def validate_rollout_mode(cfg: Config) -> None:
    """Rollouts overlapped with training (``train/sampling/source.py``)."""
    from gspo_megatron.train.sampling.source import MODES

    r = cfg.rollout
    _one_of(r.mode, MODES, "rollout.mode")
    validate_partial(cfg)
    if r.mode == "sync":
        return
    if r.mode == "async":
        if r.max_staleness < 1:
            raise ConfigError(f"rollout.max_staleness={r.max_staleness} must be >= 1 with rollout.mode=async "
                              "(0 is rollout.mode=sync)")
        if r.engine != "sglang":
            raise ConfigError(f"rollout.mode=async needs rollout.engine=sglang (its weight syncs pause the servers' "
                              f"requests in flight); rollout.engine={r.engine!r} cannot pause: use "
                              "rollout.mode=one_step_off")
    if cfg.algo.replays_old_routing:
        raise ConfigError(f"algo.routing_replay=old with rollout.mode={r.mode}: GRPO + Routing Replay replays the "
                          "experts of a recomputed old-policy pass, but a sample from older weights has no such "
                          "pass (the trainer holds newer weights and the engine's log-probs come without the old "
                          "policy's experts); set algo.routing_replay=rollout (the engine's experts) or "
                          "rollout.mode=sync")
    if r.filter_zero_variance_groups:
        raise ConfigError(f"rollout.filter_zero_variance_groups=true with rollout.mode={r.mode}: the extra prompts "
                          "of dynamic sampling are drawn mid-rollout, which a batch sampled ahead cannot do yet; "
                          "set rollout.mode=sync or rollout.filter_zero_variance_groups=false")


def validate_fp8(cfg: Config) -> None:
    """FP8 rollouts (``rollout.fp8``): SGLang servers only."""
    r = cfg.rollout
    if r.fp8_keep_layers < 0:
        raise ConfigError(f"rollout.fp8_keep_layers={r.fp8_keep_layers} must be >= 0")
    if r.fp8_keep_layers and not r.fp8:
        raise ConfigError(f"rollout.fp8_keep_layers={r.fp8_keep_layers} needs rollout.fp8=true")
    if r.fp8 and r.engine != "sglang":
        raise ConfigError(f"rollout.fp8=true needs rollout.engine=sglang: the {r.engine} engine samples with the "
                          "trainer's own weights; set rollout.fp8=false")
    if r.fp8 and r.server_args.get("dtype") in ("float", "float32"):  # before the FP8 copy is written
        raise ConfigError(f"rollout.fp8=true with rollout.server_args.dtype={r.server_args['dtype']}: SGLang's FP8 "
                          "layers compute in bfloat16 or float16 (its Fp8Config); set rollout.server_args.dtype="
                          "bfloat16")


def validate_partial(cfg: Config) -> None:
    """Partial rollouts (``rollout.partial_chunk_tokens``, ``train/sampling/partial_rollouts.py``)."""
    r = cfg.rollout
    _one_of(r.partial_mask, ("none", "old_tokens"), "rollout.partial_mask")
    if r.partial_chunk_tokens is None:
        if r.partial_mask != "none":
            raise ConfigError(f"rollout.partial_mask={r.partial_mask!r} needs rollout.partial_chunk_tokens (partial "
                              "rollouts); without it every sample comes from one weight version")
        return
    if r.partial_chunk_tokens < 1:
        raise ConfigError(f"rollout.partial_chunk_tokens={r.partial_chunk_tokens} must be >= 1 (or null: off)")
    if r.partial_groups_in_flight is not None and r.partial_groups_in_flight < r.prompts_per_step:
        raise ConfigError(f"rollout.partial_groups_in_flight={r.partial_groups_in_flight} is below "
                          f"rollout.prompts_per_step={r.prompts_per_step}: a batch needs that many groups generating")
    refused = [
        (r.mode != "sync", f"rollout.mode={r.mode}", "set rollout.mode=sync (the carried samples already overlap "
                                                     "steps)"),
        (r.filter_zero_variance_groups, "rollout.filter_zero_variance_groups=true",
         "set rollout.filter_zero_variance_groups=false"),
        (bool(r.env), f"rollout.env={r.env}", "multi-turn trajectories are not cut yet: unset rollout.env"),
        (cfg.algo.routing_replay is not None, f"algo.routing_replay={cfg.algo.routing_replay}",
         "the experts of a sample's earlier chunks are not kept: set algo.routing_replay=false"),
    ]
    for bad, what, fix in refused:
        if bad:
            raise ConfigError(f"rollout.partial_chunk_tokens={r.partial_chunk_tokens} with {what}: {fix}")


def validate(cfg: Config, world_size: int, hf: dict | None = None) -> None:
    from gspo_megatron.model.hf_config import text_config

    hf = text_config(hf) if hf is not None else None  # a multimodal wrapper (Kimi-K2.5): its text model
    a, r, o = cfg.algo, cfg.rollout, cfg.optimizer
    _one_of(a.name, ALGORITHMS, "algo.name")
    _one_of(a.grpo_aggregation, AGGREGATIONS, "algo.grpo_aggregation")
    _one_of(a.kl_estimator, KL_ESTIMATORS, "algo.kl_estimator")
    _one_of(r.engine, ENGINES, "rollout.engine")
    _one_of(r.weight_sync, WEIGHT_SYNCS, "rollout.weight_sync")
    _one_of(o.lr_decay, LR_DECAYS, "optimizer.lr_decay")
    _one_of(cfg.data.on_reward_error, ("raise", "mask"), "data.on_reward_error")
    _one_of(cfg.data.long_prompts, ("error", "drop"), "data.long_prompts")
    _one_of(cfg.data.sandbox, ("confined", "unconfined"), "data.sandbox")
    if cfg.data.reward_workers < 0:
        raise ConfigError(f"data.reward_workers={cfg.data.reward_workers} must be >= 0 (0: in the trainer's process)")
    if not (math.isfinite(cfg.data.reward_timeout_s) and cfg.data.reward_timeout_s > 0):
        raise ConfigError(f"data.reward_timeout_s={cfg.data.reward_timeout_s:g} must be a positive number of seconds")
    if not 0 < cfg.data.max_masked_reward_share <= 1:
        raise ConfigError(f"data.max_masked_reward_share={cfg.data.max_masked_reward_share:g} must be in (0, 1] "
                          "(1: only a step with every reward masked stops the run)")
    if cfg.data.masked_reward_window < 1:
        raise ConfigError(f"data.masked_reward_window={cfg.data.masked_reward_window} must be >= 1 (steps)")
    _one_of(r.on_truncated, ("keep", "mask"), "rollout.on_truncated")
    _one_of(a.token_advantages, TOKEN_ADVANTAGES, "algo.token_advantages")
    if a.token_advantages == "segments":
        if a.name == "gspo":
            raise ConfigError("algo.token_advantages='segments' needs a loss with per-token advantages: GSPO's "
                              "sequence ratio takes one advantage per sequence; set algo.name=gspo_token (or grpo)")
        if not cfg.data.segment_reward:
            raise ConfigError("algo.token_advantages='segments' needs data.segment_reward (synthetic, or "
                              "module:function returning [(end, reward), ...] per response)")
    validate_env(cfg)
    validate_rollout_mode(cfg)
    validate_fp8(cfg)
    from gspo_megatron.train.sampling import colocate  # rollout.colocate's rules
    colocate.validate(cfg)
    if a.routing_replay not in (None, "old", "rollout"):
        raise ConfigError(f"algo.routing_replay={a.routing_replay!r} is not one of false, old (or true: replay the "
                          "old policy's experts), rollout (replay the experts the rollout engine routed to)")
    # return_routed_experts: SGLang's name for the engine's routes (rollout.config.SGLangConfig)
    if a.replays_rollout_routing and r.server_args.get("return_routed_experts") is False:
        raise ConfigError("algo.routing_replay=rollout needs the servers' routed experts: remove "
                          "rollout.server_args.return_routed_experts=false")
    if a.replays_old_routing and a.name != "grpo":
        raise ConfigError(f"algo.routing_replay=old is the GRPO baseline's fix; GSPO does not need it "
                          f"(algo.name={a.name!r}): set algo.name=grpo or algo.routing_replay=false")
    if a.decoupled_clip and r.reuse_rollout_logprobs:
        raise ConfigError("algo.decoupled_clip=true clips around the trainer's old-policy pass, but "
                          "rollout.reuse_rollout_logprobs=true takes the engine's log-probs as pi_old: unset one")
    try:  # the correction's own rules (algo.correction.Correction), before anything starts
        correction(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name in ("kl_coef", "entropy_coef"):
        value = getattr(a, name)
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"algo.{name}={value} must be finite and >= 0")
        if value and cfg.parallel.context > 1:
            raise ConfigError(f"algo.{name}={value} with parallel.context={cfg.parallel.context}: only the GSPO term "
                              f"reduces over context-parallel ranks so far; set algo.{name}=0")
    if r.group_size < 2:
        raise ConfigError(f"rollout.group_size={r.group_size}: group advantages need at least 2 responses per prompt")
    _positive(cfg.train.steps, "train.steps")
    from gspo_megatron.train.startup.policy import DTYPES

    if cfg.model.dtype not in DTYPES:
        raise ConfigError(unknown_names([cfg.model.dtype], DTYPES, "model.dtype: unknown dtype").replace(
            "known:", "one of:"))
    validate_server_args(cfg)
    for name in ("prompts_per_step", "max_new_tokens", "temperature", "max_sampling_rounds"):
        _positive(getattr(r, name), f"rollout.{name}")
    _positive(a.minibatches, "algo.minibatches")
    if cfg.train.cpu_threads is not None:
        _positive(cfg.train.cpu_threads, "train.cpu_threads")
    vocab = hf.get("vocab_size") if hf else None
    for i, token in enumerate(r.stop_token_ids):
        if token < 0 or (vocab is not None and token >= vocab):
            raise ConfigError(f"rollout.stop_token_ids[{i}]={token} is not a token id of the vocabulary "
                              f"(0..{vocab - 1 if vocab else 'vocab_size - 1'})")
    if cfg.train.max_consecutive_nonfinite < 0:
        raise ConfigError(f"train.max_consecutive_nonfinite={cfg.train.max_consecutive_nonfinite} must be >= 0 "
                          "(0: never stop on non-finite steps)")
    _positive(o.lr, "optimizer.lr") if o.lr != 0 else None
    validate_optimizer(cfg)
    validate_timeouts(cfg)
    dp = validate_layout(cfg, world_size)
    if hf is not None:
        validate_model(cfg, hf)
    check_recompute(cfg, hf)
    check_performance(cfg)
    batch = r.prompts_per_step * r.group_size
    _divides(batch, a.minibatches, "rollout.prompts_per_step*group_size", "algo.minibatches")
    if cfg.parallel.max_tokens_per_micro_batch is None:
        _divides(batch // a.minibatches, dp * cfg.parallel.micro_batch_size, "sequences per minibatch",
                 "data-parallel size * parallel.micro_batch_size",
                 "every data-parallel rank needs whole micro batches of each minibatch")
    else:
        _divides(batch // a.minibatches, dp, "sequences per minibatch", "data-parallel size",
                 "every data-parallel rank needs an equal share of each minibatch")
    if not (cfg.data.prompts or cfg.data.task):
        raise ConfigError("data.prompts (a JSONL file) or data.task (a built-in task) must be set")
    if cfg.data.prompts and cfg.data.task:
        raise ConfigError("set one of data.prompts and data.task, not both")
