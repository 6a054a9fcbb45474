"""Colocated rollouts in the plan (``rollout.colocate``): the trainer's and the SGLang servers' memory on each GPU in
every phase of a step (rollout, train, sync), and whether the sum fits; the loop's side is
``train/sampling/colocate.py``."""

from __future__ import annotations

from dataclasses import dataclass

from gspo_megatron.plan.memory import GIB, model_parameters
from gspo_megatron.train.startup.config import Config


ENGINE_RESIDUAL_GIB = 1.5
"""An SGLang process's GPU memory outside its static pool, on a GPU it shares (an estimate, not measured: no GPU
here): its CUDA context, NCCL / custom all-reduce buffers and decode activations; what stays after a release."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": None}


@dataclass
class ColocatedPhase:
    """One phase's resident memory on the most loaded GPU, in bytes."""

    phase: str
    trainer: float
    engine: float
    what: str

    @property
    def total(self) -> float:
        return self.trainer + self.engine


@dataclass
class ColocatedPlan:
    phases: list[ColocatedPhase]
    gpu_bytes: float
    mem_fraction_static: float | None
    largest_fraction: float  # the largest mem_fraction_static the rollout phase leaves room for
    engine_weights: float  # per GPU
    kv_cache: float  # per GPU: the static pool less the weights
    kv_needed: float  # per GPU: one group of samples at full length
    problems: list[str]
    offloaded: float = 0.0  # per GPU: optimizer state on the host + gradient buffers freed (colocate_offload)

    @property
    def fits(self) -> bool:
        return not self.problems


def colocated_plan(cfg: Config, spec, estimate, gpu_memory_gib: float, bucket_bytes: int = 256 << 20
                   ) -> ColocatedPlan:
    """Both sides on one GPU, phase by phase. The trainer keeps its weights, gradient buffer and optimizer state
    through the rollout, or with ``rollout.colocate_offload=optimizer`` its weights only (the optimizer state on the
    host and the gradient buffers freed from the update's end to the next update: the sync and rollout phases); the
    servers hold ``mem_fraction_static`` of the GPU (weights + KV cache) while generating, only their residual while
    training, and weights without KV cache while the sync writes into them (one bucket of the trainer's beside).
    Problems name the knob to turn."""

    r, args = cfg.rollout, cfg.rollout.server_args
    gpu = gpu_memory_gib * GIB
    engine_tp = int(args.get("tp_size", 1))
    total_params, _ = model_parameters(spec)
    serve_bytes = DTYPE_BYTES.get(str(args.get("dtype", "auto"))) or (4 if cfg.model.dtype == "float32" else 2)
    weights = total_params * serve_bytes / engine_tp
    kv_heads = max(1, spec.num_key_value_heads // engine_tp)
    kv_per_token = 2 * spec.num_layers * kv_heads * spec.head_dim * serve_bytes
    kv_needed = kv_per_token * r.group_size * (r.max_prompt_tokens + r.max_new_tokens)
    residual = ENGINE_RESIDUAL_GIB * GIB
    worst = estimate.worst
    offloaded = worst.optimizer + worst.grads if r.colocate_offload == "optimizer" else 0.0
    trainer_state = worst.state - offloaded + estimate.fixed_bytes  # between updates, plus CUDA context and NCCL
    largest = max(0.0, (gpu - trainer_state - residual) / gpu)
    fraction = args.get("mem_fraction_static")
    static = (fraction or 0.0) * gpu
    held = "weights (optimizer state on the host)" if offloaded else "weights, gradients, optimizer"
    phases = [
        ColocatedPhase("rollout", trainer_state, static + residual,
                       f"servers: weights + KV cache (mem_fraction_static); trainer: {held}"),
        ColocatedPhase("train", estimate.total_bytes, residual,
                       "servers released; trainer: its peak (activations of the micro batches in flight)"),
        ColocatedPhase("sync", trainer_state + bucket_bytes, weights + residual,
                       "servers' weights resumed (KV cache still released); trainer: state + one bucket"),
    ]
    knob = "rollout.server_args.mem_fraction_static"  # SGLang's --mem-fraction-static
    problems = []
    if fraction is None:
        problems.append(f"rollout.colocate on GPUs needs {knob} (--mem-fraction-static): SGLang would size its pool from the memory free at "
                        f"its start, which training needs back; at most {largest:.2f} leaves room for the trainer")
    elif fraction > largest:
        problems.append(f"{knob}={fraction:g} (--mem-fraction-static) leaves the trainer too little during the "
                        f"rollout: at most "
                        f"{largest:.2f} fits beside the trainer's {trainer_state / GIB:.1f} GiB")
    if fraction is not None and static - weights < kv_needed:
        problems.append(f"{knob}={fraction:g} (--mem-fraction-static) leaves {(static - weights) / GIB:.2f} GiB of KV cache per GPU after "
                        f"the servers' weights ({weights / GIB:.1f} GiB), less than one group of samples needs "
                        f"({kv_needed / GIB:.2f} GiB): raise it, or rollout.server_args.tp_size")
    for phase in phases[1:]:
        if phase.total > gpu:
            problems.append(f"the {phase.phase} phase needs {phase.total / GIB:.1f} GiB of {gpu_memory_gib:g}: "
                            + ("the trainer alone is too large (see the memory lines above)" if phase.phase == "train"
                               else "raise rollout.server_args.tp_size (the servers' weights per GPU)"))
    return ColocatedPlan(phases, gpu, fraction, largest, weights, static - weights, kv_needed, problems, offloaded)


def plan_lines(plan: ColocatedPlan) -> list[str]:

    lines = ["colocated (rollout.colocate): trainer + SGLang servers per GPU, by phase:"]
    for p in plan.phases:
        lines.append(f"  {p.phase:<8} trainer {p.trainer / GIB:7.2f} GiB + servers {p.engine / GIB:7.2f} GiB = "
                     f"{p.total / GIB:7.2f} GiB  ({p.what})")
    lines.append(f"  servers  weights {plan.engine_weights / GIB:.2f} GiB per GPU, KV cache "
                 f"{plan.kv_cache / GIB:.2f} GiB (one group needs {plan.kv_needed / GIB:.2f}); "
                 f"mem_fraction_static {plan.mem_fraction_static} (at most {plan.largest_fraction:.2f} fits)")
    if plan.offloaded:
        lines.append(f"  trainer  rollout.colocate_offload=optimizer: {plan.offloaded / GIB:.2f} GiB per GPU off it "
                     "between updates (optimizer state in pinned host memory, gradient buffers freed)")
    lines += [f"  DOES NOT FIT: {p}" for p in plan.problems] or ["  colocated: fits"]
    return lines

