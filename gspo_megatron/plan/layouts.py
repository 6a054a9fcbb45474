"""``gspo-megatron plan``: the resolved parallel layout and the per-GPU memory, before launching.

Ranks per group come from megatron-core's own ``RankGenerator`` (order tp-cp-ep-dp-pp, as
``initialize_model_parallel`` uses), so what is printed is what the run will build. Memory is counted by
``plan.memory`` for the run's settings (recompute, padded length, micro batches in flight, KL reference), and
printed with those assumptions and per component.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from gspo_megatron.train.startup.config import Config, ConfigError
from gspo_megatron.plan.memory import (
    GIB, MemoryEstimate, Overhead, StageMemory, estimate_memory, model_parameters, padded_length,
)

H100_GIB = 79.1
"""What torch reports as an H100 80 GB's total capacity (``torch.cuda.get_device_properties(0).total_memory``)."""
DGX_H100_HOST_GIB = 2048.0
"""A DGX H100's system memory (2 TiB: 32 x 64 GiB DIMMs), what ``plan`` checks an offloaded optimizer against."""

ACTIVATION_GROUPS = {
    "routed experts": ("mlp.router", "mlp.routed_tokens", "mlp.experts"),
    "shared experts": ("mlp.shared_experts",),
    "dense MLPs": ("mlp.mlp",),
    "attention": ("qkv", "qk_norm", "q_k_rotated", "q_k_v_bmm", "softmax", "causal_mask", "context", "rope_tables",
                  "mla_latents", "output_gate"),
    "gated DeltaNet": ("in_proj", "conv", "qk_l2norm", "decay_beta", "chunk_A", "core_out", "gated_norm"),
    "norms": ("input_norm", "mlp.pre_mlp_norm", "final_norm"),
    "recomputed layers' inputs": ("recompute_inputs",),
}


def read_hf_config(cfg: Config) -> dict:
    """The model's Hugging Face config: ``model.hf_dir``'s config.json, or the one ``model.tiny`` builds."""
    if cfg.model.hf_dir and (Path(cfg.model.hf_dir) / "config.json").is_file():
        return json.loads((Path(cfg.model.hf_dir) / "config.json").read_text())
    if cfg.model.tiny:
        from gspo_megatron.rewards.synthetic import tiny_config

        return tiny_config(**cfg.model.tiny).to_dict()
    raise ConfigError(
        f"model.hf_dir={cfg.model.hf_dir!r} has no config.json (and model.tiny is empty): point it at a "
        "Hugging Face model directory"
    )


def rank_groups(world_size: int, cfg: Config) -> dict[str, list[list[int]]]:
    """Ranks in each TP/CP/EP/DP/PP group, exactly as megatron-core builds them."""
    from megatron.core.parallel_state import RankGenerator

    p = cfg.parallel
    tp, pp, cp, ep = p.tensor, p.pipeline, p.context, p.expert
    etp = p.expert_tensor or tp
    dp = world_size // (tp * pp * cp)
    decoder = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    experts = RankGenerator(tp=etp, ep=ep, dp=world_size // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    return {
        "tensor": decoder.get_ranks("tp"),
        "pipeline": decoder.get_ranks("pp"),
        "context": decoder.get_ranks("cp"),
        "data": decoder.get_ranks("dp"),
        "expert": experts.get_ranks("ep"),
        "expert_tensor": experts.get_ranks("tp"),
        "expert_data": experts.get_ranks("dp"),
    }


def _gib(value: float) -> str:
    return f"{value / GIB:8.2f} GiB" if value >= 0.1 * GIB or value == 0 else f"{value / 2**20:8.2f} MiB"


def _recompute(cfg: Config) -> str:
    r = cfg.recompute
    if r.granularity == "selective":
        return f"selective, modules {list(r.modules)}"
    if r.granularity == "full":
        return f"full, method {r.method}, {r.num_layers} layer(s)"
    return "none (every activation kept)"


def _activation_breakdown(stage: StageMemory) -> str:
    per_micro = stage.activation_terms
    parts = []
    for group, names in ACTIVATION_GROUPS.items():
        value = sum(per_micro.get(name, 0.0) for name in names)
        if value:
            parts.append(f"{group} {value / GIB:.2f}")
    return ", ".join(parts)


def grad_dtype(cfg: Config) -> str:
    """The gradient buffer's dtype: fp32 (optimizer.grad_reduce_in_fp32), else the parameters'."""
    return "fp32" if cfg.optimizer.grad_reduce_in_fp32 or cfg.model.dtype != "bfloat16" else "bf16"


def memory_lines(cfg: Config, estimate: MemoryEstimate, world_size: int, gpu_memory_gib: float,
                 gpus_per_node: int = 0, host_memory_gib: float = DGX_H100_HOST_GIB) -> list[str]:
    """The assumptions, the most loaded rank's components, and the verdict (and, with the optimizer offloaded, the
    host memory per node against ``host_memory_gib``)."""
    p = cfg.parallel
    o = estimate.overhead
    worst = estimate.worst
    etp = p.expert_tensor or p.tensor
    dp_cp = world_size // (p.tensor * p.pipeline)
    edp = world_size // (etp * p.expert * p.pipeline)
    impl = ("TransformerEngine spec (fused norms, flash attention)" if estimate.impl == "te"
            else "megatron's local spec (torch norms, unfused attention)")
    response = "max_trajectory_tokens" if cfg.rollout.env else "max_new_tokens"
    lines = [
        "assumptions:",
        f"  layers       {impl}, {cfg.model.dtype}",
        (f"  sequences    every micro batch one packed row of at most {estimate.seq_len} tokens "
         + ("(parallel.max_tokens_per_micro_batch, or one longer sequence)" if p.max_tokens_per_micro_batch else
            f"(parallel.micro_batch_size rows of rollout.max_prompt_tokens + {response})")
         if p.pack_sequences else
         f"  sequences    every micro batch padded to {estimate.seq_len} tokens (rollout.max_prompt_tokens + "
         f"{response}: rows are padded to the rollout's longest)"),
        (f"  micro batch  up to {estimate.micro_batches} (one per sequence)" if p.max_tokens_per_micro_batch else
         f"  micro batch  {p.micro_batch_size} sequence(s); {estimate.micro_batches}")
        + " per minibatch per data-parallel rank; in flight (1F1B): "
        + ", ".join(f"{st.micro_batches_in_flight} on the {st.stage} stage" for st in estimate.stages),
        f"  recompute    {_recompute(cfg)}",
        "  KL reference " + ("a frozen copy of the weights (algo.kl_coef > 0)" if cfg.algo.kl_coef > 0
                             else "none (algo.kl_coef = 0)"),
        f"  overhead     CUDA context {o.cuda_context_gib:.1f} GiB + NCCL {o.nccl_gib:.1f} GiB, allocator slack "
        f"{o.allocator_slack:.0%} of the tensors (plan.memory.Overhead)",
    ]
    lines += [f"  note         {note}" for note in estimate.notes]
    optimizer = "distributed: dense over DP x CP " + f"{dp_cp}, experts over expert-DP {edp}" \
        if p.distributed_optimizer else "not distributed"
    per_micro = worst.activations / max(1, worst.micro_batches_in_flight)
    lines += [
        f"memory per GPU, most loaded rank ({worst.stage} pipeline stage):",
        f"  parameters   {_gib(worst.params)}",
        f"  gradients    {_gib(worst.grads)}  ({grad_dtype(cfg)} buffer)",
        f"  optimizer    {_gib(worst.optimizer)}  ({optimizer}"
        + (f"; {f:.0%} of it in host memory" if (f := cfg.optimizer.offload_fraction) else "") + ")",
    ]
    if worst.reference:
        lines.append(f"  reference    {_gib(worst.reference)}  (KL reference model)")
    if worst.workspace:
        lines.append(f"  workspace    {_gib(worst.workspace)}  (megatron's global buffer: unfused attention scores)")
    lines += [
        f"  activations  {_gib(worst.activations)}  ({worst.micro_batches_in_flight} x {per_micro / GIB:.2f} GiB: "
        f"{_activation_breakdown(worst)})",
        f"  working      {_gib(worst.working)}  (peak on top: {worst.working_what})",
        f"  tensors      {_gib(worst.tensors)}  (what torch.cuda.max_memory_allocated would show)",
        f"  slack        {_gib(estimate.slack_bytes)}",
        f"  CUDA + NCCL  {_gib(estimate.fixed_bytes)}",
    ]
    fits = estimate.total_bytes <= gpu_memory_gib * GIB
    lines.append(f"  total        {_gib(estimate.total_bytes)} of {gpu_memory_gib:.1f} GiB: "
                 + ("fits" if fits else "DOES NOT FIT"))
    others = [st for st in estimate.stages if st is not worst]
    for st in others:
        lines.append(f"  ({st.stage} stage: tensors {st.tensors / GIB:.2f} GiB)")
    if cfg.optimizer.offload_fraction:
        node = gpus_per_node or world_size
        host = estimate.host_bytes_per_node(node)
        lines += [
            f"host memory per node ({node} ranks; optimizer.offload_fraction={cfg.optimizer.offload_fraction:g}):",
            f"  optimizer    {_gib(estimate.host_optimizer)} per rank (fp32 master, Adam's moments, fp32 gradient copy: 16 B per "
            "offloaded element of its shard)",
            f"  processes    {_gib(o.host_process_gib * GIB)} per rank (plan.memory.Overhead.host_process_gib)",
            f"  total        {_gib(host)} of {host_memory_gib:.0f} GiB (--host-memory-gib): "
            + ("fits" if host <= host_memory_gib * GIB else "DOES NOT FIT"),
        ]
    return lines


def format_plan(cfg: Config, world_size: int, gpu_memory_gib: float = H100_GIB, impl: str = "te",
                overhead: Overhead = Overhead(), gpus_per_node: int = 0,
                host_memory_gib: float = DGX_H100_HOST_GIB) -> str:
    from gspo_megatron.model.hf_config import read_hf_config as model_spec
    from gspo_megatron.train.startup.validate import validate

    hf = read_hf_config(cfg)
    validate(cfg, world_size, hf)
    spec = model_spec(hf)
    total, active = model_parameters(spec)
    groups = rank_groups(world_size, cfg)
    estimate = estimate_memory(spec, cfg, world_size, padded_length(cfg), impl=impl, overhead=overhead)
    p = cfg.parallel
    dp = world_size // (p.tensor * p.pipeline * p.context)
    moe_layers = sum(spec.moe_layers) if spec.moe_layers else 0
    lines = [
        f"model: {hf.get('model_type', '?')}  {total / 1e9:.2f}B parameters ({active / 1e9:.2f}B active), "
        f"{spec.num_layers} layers ({moe_layers} MoE, {spec.num_experts} experts, top-{spec.moe_topk}), "
        f"vocab {spec.vocab_size}",
        f"world: {world_size} ranks = TP {p.tensor} x CP {p.context} x PP {p.pipeline} x DP {dp}; "
        f"experts: EP {p.expert} x expert-TP {p.expert_tensor or p.tensor} x expert-DP "
        f"{world_size // ((p.expert_tensor or p.tensor) * p.expert * p.pipeline)}",
    ]
    for name, ranks in groups.items():
        def fmt(group):
            return str(group) if len(group) <= 8 else f"[{', '.join(map(str, group[:4]))}, ..., {group[-1]}] ({len(group)} ranks)"

        shown = ", ".join(fmt(g) for g in ranks[:4]) + (f", ... ({len(ranks)} groups)" if len(ranks) > 4 else "")
        lines.append(f"  {name:<14} groups: {shown}")
    lines += memory_lines(cfg, estimate, world_size, gpu_memory_gib, gpus_per_node, host_memory_gib)
    lines += server_lines(spec, cfg)
    if cfg.rollout.colocate:  # [colocate hook] both sides' memory per phase (plan/colocated.py)
        from gspo_megatron.plan import colocated
        lines += colocated.plan_lines(colocated.colocated_plan(cfg, spec, estimate, gpu_memory_gib))
    return "\n".join(lines)


def server_lines(spec, cfg: Config) -> list[str]:
    """The rollout servers' side (``train.plan_servers``): the KV cache per token, the weight sync's time and, with
    FP8 rollouts (``rollout.fp8``), the servers' weights in FP8 against bf16 (``ServerLayout.weight_bytes``)."""
    from gspo_megatron.rollout.config import WeightSyncConfig
    from gspo_megatron.plan.servers import (ServerLayout, attention_layers, deltanet_state_bytes_per_sequence,
                                            fp8_bytes_per_parameter, kv_cache_bytes_per_token, model_sync_estimate,
                                            server_weights_per_gpu)

    per_token = kv_cache_bytes_per_token(spec)
    if spec.attention == "mla":
        how = (f"multi-latent: (kv_lora_rank {spec.kv_lora_rank} + qk_rope {spec.qk_rope_head_dim}) x "
               f"{spec.num_layers} layers x 2 B, on every attention-TP GPU")
    else:
        per_gpu = kv_cache_bytes_per_token(spec, attention_tp=spec.num_key_value_heads)
        layers = attention_layers(spec)
        kind = "full-attention layers" if layers < spec.num_layers else "layers"
        how = (f"{layers} {kind} x (K, V) x {spec.num_key_value_heads} KV heads x {spec.head_dim} x 2 B, "
               f"heads split over attention-TP: {per_gpu / 1024:.1f} KiB per GPU from attention-TP "
               f"{spec.num_key_value_heads} on")
    bucket = WeightSyncConfig.bucket_bytes
    lines = ["rollout servers (SGLang 0.5.23; estimates, train.plan_servers):",
             f"  KV cache     {per_token / 1024:.1f} KiB per token in bf16 ({how})"]
    if spec.linear_attention_layers:
        state = deltanet_state_bytes_per_sequence(spec)
        lines.append(f"  DeltaNet     {state / 2**20:.1f} MiB of state per running sequence, whatever its length "
                     f"({spec.num_layers - layers} layers x {spec.linear_num_value_heads} value heads x "
                     f"{spec.linear_key_head_dim} x {spec.linear_value_head_dim} fp32, and the conv's last "
                     f"{spec.linear_conv_kernel_dim - 1} inputs in bf16; split over attention-TP)")
    bytes_per_parameter, dtype = 2, "bf16"
    if cfg.rollout.fp8:
        from gspo_megatron.model.fp8 import Fp8Scheme

        scheme = Fp8Scheme(spec.num_layers, keep_layers=cfg.rollout.fp8_keep_layers)
        bytes_per_parameter, dtype = fp8_bytes_per_parameter(spec, scheme), "FP8 + scales, bf16 rest"
        bf16, fp8 = (server_weights_per_gpu(spec, ServerLayout(tp=1, weight_bytes=w)) for w in (2.0, 1.0))
        lines.append(f"  weights      {fp8 / 1e9:.0f} GB in FP8 (rollout.fp8) instead of {bf16 / 1e9:.0f} GB in bf16 "
                     f"per server: {(bf16 - fp8) / 1e9:.0f} GB more for its KV cache")
    sync = model_sync_estimate(spec, bucket, bytes_per_parameter)
    low, high = sync.seconds
    lines.append(f"  weight sync  {sync.gigabytes:.0f} GB ({dtype}) into every server GPU: ~{low:.1f}-{high:.1f} s "
                 f"({sync.wire_s:.1f} s at 45 GB/s per GPU + {sync.buckets} buckets of {bucket >> 20} MiB x 3 ms "
                 "+ load_weights)")
    return lines


def fits(cfg: Config, world_size: int, gpu_memory_gib: float = H100_GIB, impl: str = "te",
         overhead: Overhead = Overhead(), gpus_per_node: int = 0, host_memory_gib: float = DGX_H100_HOST_GIB) -> bool:
    """The most loaded rank within ``gpu_memory_gib`` (and the colocated servers beside it), and an offloaded
    optimizer's host memory within ``host_memory_gib`` per node of ``gpus_per_node`` ranks (0: all on one)."""
    from gspo_megatron.model.hf_config import read_hf_config as model_spec

    spec = model_spec(read_hf_config(cfg))
    estimate = estimate_memory(spec, cfg, world_size, padded_length(cfg), impl=impl, overhead=overhead)
    if estimate.host_bytes_per_node(gpus_per_node or world_size) > host_memory_gib * GIB:
        return False
    if cfg.rollout.colocate:  # [colocate hook] the servers' share too, in every phase (plan/colocated.py)
        from gspo_megatron.plan import colocated
        if not colocated.colocated_plan(cfg, spec, estimate, gpu_memory_gib).fits:
            return False
    return estimate.total_bytes <= gpu_memory_gib * GIB


def _changed(cfg: Config, **fields) -> Config:
    """A copy of ``cfg`` with ``section__field=value`` changes."""
    out = copy.deepcopy(cfg)
    for key, value in fields.items():
        section, name = key.split("__")
        setattr(getattr(out, section), name, value)
    return out


def fit_options(cfg: Config, world_size: int, gpu_memory_gib: float = H100_GIB, impl: str = "te",
                overhead: Overhead = Overhead(), gpus_per_node: int = 0,
                host_memory_gib: float = DGX_H100_HOST_GIB) -> list[str]:
    """Single changes that make a layout that does not fit fit (each checked like the layout itself): recompute,
    more expert/pipeline/tensor parallelism, a smaller micro batch or token budget, shorter responses, the
    distributed optimizer, the optimizer in host memory with bf16 gradients, twice the nodes."""
    from gspo_megatron.train.startup.validate import validate

    p, r = cfg.parallel, cfg.recompute
    tries: list[tuple[str, Config, int]] = []
    if r.granularity == "none":
        tries.append(("recompute.granularity=selective recompute.modules=[moe]",
                      _changed(cfg, recompute__granularity="selective", recompute__modules=["moe"]), world_size))
    elif r.granularity == "selective" and "moe" not in r.modules:
        modules = [*r.modules, "moe"]
        tries.append((f"recompute.modules=[{', '.join(modules)}]", _changed(cfg, recompute__modules=modules),
                      world_size))
    if r.granularity != "full":
        tries.append(("recompute.granularity=full", _changed(cfg, recompute__granularity="full",
                                                             recompute__method="uniform", recompute__num_layers=1),
                      world_size))
    if not p.distributed_optimizer:
        tries.append(("parallel.distributed_optimizer=true", _changed(cfg, parallel__distributed_optimizer=True),
                      world_size))
    o = cfg.optimizer
    if cfg.model.dtype == "bfloat16" and (o.offload_fraction < 1 or o.grad_reduce_in_fp32):
        # What a GPU keeps of a parameter drops from 18 B to 4 B (bf16 weight and gradient): both fields together.
        tries.append(("optimizer.offload_fraction=1 optimizer.grad_reduce_in_fp32=false",
                      _changed(cfg, optimizer__offload_fraction=1.0, optimizer__grad_reduce_in_fp32=False),
                      world_size))
    for name in ("expert", "pipeline", "tensor"):
        for factor in (2, 4):
            value = getattr(p, name) * factor
            tries.append((f"parallel.{name}={value}", _changed(cfg, **{f"parallel__{name}": value}), world_size))
    if p.micro_batch_size > 1:
        tries.append((f"parallel.micro_batch_size={p.micro_batch_size // 2}",
                      _changed(cfg, parallel__micro_batch_size=p.micro_batch_size // 2), world_size))
    if p.max_tokens_per_micro_batch:
        tries.append((f"parallel.max_tokens_per_micro_batch={p.max_tokens_per_micro_batch // 2}",
                      _changed(cfg, parallel__max_tokens_per_micro_batch=p.max_tokens_per_micro_batch // 2),
                      world_size))
    if cfg.rollout.max_new_tokens > 1 and not cfg.rollout.env:
        tries.append((f"rollout.max_new_tokens={cfg.rollout.max_new_tokens // 2}",
                      _changed(cfg, rollout__max_new_tokens=cfg.rollout.max_new_tokens // 2), world_size))
    nodes = world_size // gpus_per_node if gpus_per_node else 0
    tries.append((f"--nodes {nodes * 2}" if nodes else f"{world_size * 2} ranks", cfg, world_size * 2))
    hf = read_hf_config(cfg)
    found = []
    for label, changed, world in tries:
        try:
            validate(changed, world, hf)
            if fits(changed, world, gpu_memory_gib, impl, overhead, gpus_per_node, host_memory_gib):
                found.append(label)
        except (ConfigError, ValueError):
            continue
    return found
