"""``gspo-megatron plan``: the resolved parallel layout and a per-GPU memory estimate, before launching.

Ranks per group come from megatron-core's own ``RankGenerator`` (order tp-cp-ep-dp-pp, as
``initialize_model_parallel`` uses), so what is printed is what the run will build.

Memory per GPU, for the most loaded rank (the first pipeline stage holds the embedding and the most
in-flight micro batches; the last holds the output layer):
- parameters: bf16 (2 B) or fp32 (4 B) per parameter held; dense weights are split over TP (and layers
  over PP), experts over EP x expert-TP;
- gradients: fp32 main grads (4 B/param; megatron's grad_reduce_in_fp32);
- optimizer: Adam fp32 master weights + two moments (12 B/param), divided over the data-parallel group
  (expert-data-parallel for experts) with the distributed optimizer;
- activations: per layer and micro batch, 34*s*b*h / tp bytes for the transformer block with sequence
  parallelism and selective recompute (Korthikanti et al. 2022) plus the routed expert activations
  (top-k * s*b * (h + 3 * moe_ffn) * 2 B / (EP*expert-TP)), times the layers on the stage and the
  micro batches in flight under 1F1B (up to PP on the first stage). Log-probs use the fused op, so no
  [tokens, vocab] logits appear: one chunk buffer (256 MiB) is added instead.
These are estimates (allocator fragmentation, NCCL buffers and the CUDA context add a few GB).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from gspo_megatron.train.config import Config, ConfigError

GIB = 1024**3


@dataclass
class ModelDims:
    """The sizes the estimate needs, read from a Hugging Face config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    moe_ffn: int
    experts: int
    topk: int
    vocab: int
    tied: bool
    moe_layers: int

    @classmethod
    def from_hf_config(cls, hf: dict) -> "ModelDims":
        try:
            hidden, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
        except KeyError as missing:
            raise ConfigError(f"HF config is missing {missing}") from None
        experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        mlp_only = set(hf.get("mlp_only_layers") or [])
        step = hf.get("decoder_sparse_step", 1) or 1
        moe_layers = sum(1 for i in range(layers) if experts and i not in mlp_only and (i + 1) % step == 0)
        return cls(
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hidden // heads,
            ffn=hf.get("intermediate_size", 4 * hidden),
            moe_ffn=hf.get("moe_intermediate_size", 0),
            experts=experts,
            topk=hf.get("num_experts_per_tok", 0),
            vocab=hf["vocab_size"],
            tied=bool(hf.get("tie_word_embeddings", False)),
            moe_layers=moe_layers,
        )

    @property
    def attention_params(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        return q + kv + self.heads * self.head_dim * self.hidden + 2 * self.hidden + 2 * self.head_dim

    @property
    def expert_params_per_layer(self) -> int:
        return self.experts * 3 * self.hidden * self.moe_ffn

    @property
    def total_params(self) -> int:
        dense_mlp = (self.layers - self.moe_layers) * 3 * self.hidden * self.ffn
        moe = self.moe_layers * (self.expert_params_per_layer + self.experts * self.hidden)
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.attention_params + dense_mlp + moe + embeddings + self.hidden

    @property
    def active_params(self) -> int:
        inactive = self.moe_layers * (self.experts - self.topk) * 3 * self.hidden * self.moe_ffn
        return self.total_params - inactive


def read_hf_config(cfg: Config) -> dict:
    if cfg.model.hf_dir and (Path(cfg.model.hf_dir) / "config.json").is_file():
        return json.loads((Path(cfg.model.hf_dir) / "config.json").read_text())
    if cfg.model.tiny:
        return dict(cfg.model.tiny)
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


@dataclass
class MemoryEstimate:
    params_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float

    @property
    def total_gib(self) -> float:
        return self.params_gib + self.grads_gib + self.optimizer_gib + self.activations_gib


def estimate_memory(dims: ModelDims, cfg: Config, world_size: int, seq_len: int) -> MemoryEstimate:
    p = cfg.parallel
    tp, pp, cp, ep = p.tensor, p.pipeline, p.context, p.expert
    etp = p.expert_tensor or tp
    dp = world_size // (tp * pp * cp)
    edp = world_size // (etp * ep * pp)
    layers_per_stage = math.ceil(dims.layers / pp)
    moe_layers_per_stage = math.ceil(dims.moe_layers / pp)
    dense_layers_per_stage = layers_per_stage - moe_layers_per_stage

    dense = layers_per_stage * dims.attention_params + dense_layers_per_stage * 3 * dims.hidden * dims.ffn
    dense += moe_layers_per_stage * dims.experts * dims.hidden  # routers (replicated over TP)
    dense += dims.vocab * dims.hidden * (1 if pp > 1 or dims.tied else 2)  # embedding (and output layer)
    dense_per_rank = dense / tp
    expert_per_rank = moe_layers_per_stage * dims.expert_params_per_layer / (ep * etp)

    param_bytes = 2 if cfg.model.dtype == "bfloat16" else 4
    params = (dense_per_rank + expert_per_rank) * param_bytes
    grads = (dense_per_rank + expert_per_rank) * 4
    if p.distributed_optimizer:
        optimizer = 12 * (dense_per_rank / dp + expert_per_rank / edp)
    else:
        optimizer = 12 * (dense_per_rank + expert_per_rank)
    if param_bytes == 4:
        optimizer -= 4 * (dense_per_rank / (dp if p.distributed_optimizer else 1))  # fp32 params are the master copy
        optimizer -= 4 * (expert_per_rank / (edp if p.distributed_optimizer else 1))

    tokens = seq_len * p.micro_batch_size / cp
    block = 34 * tokens * dims.hidden / tp
    routed = dims.topk * tokens * (dims.hidden + 3 * dims.moe_ffn) * 2 / (ep * etp) if dims.experts else 0
    in_flight = min(pp, max(1, cfg.rollout.prompts_per_step * cfg.rollout.group_size // max(1, cfg.algo.minibatches)
                            // max(1, dp * p.micro_batch_size)))
    activations = in_flight * (layers_per_stage * block + moe_layers_per_stage * routed) + 256 * 1024**2
    return MemoryEstimate(params / GIB, grads / GIB, optimizer / GIB, activations / GIB)


def format_plan(cfg: Config, world_size: int, gpu_memory_gib: float = 80.0) -> str:
    from gspo_megatron.train.validate import validate

    hf = read_hf_config(cfg)
    dims = ModelDims.from_hf_config(hf)
    validate(cfg, world_size, hf)
    seq_len = cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens
    groups = rank_groups(world_size, cfg)
    mem = estimate_memory(dims, cfg, world_size, seq_len)
    p = cfg.parallel
    dp = world_size // (p.tensor * p.pipeline * p.context)
    lines = [
        f"model: {hf.get('model_type', '?')}  {dims.total_params / 1e9:.2f}B parameters "
        f"({dims.active_params / 1e9:.2f}B active), {dims.layers} layers ({dims.moe_layers} MoE, "
        f"{dims.experts} experts, top-{dims.topk}), vocab {dims.vocab}",
        f"world: {world_size} ranks = TP {p.tensor} x CP {p.context} x PP {p.pipeline} x DP {dp}; "
        f"experts: EP {p.expert} x expert-TP {p.expert_tensor or p.tensor} x expert-DP "
        f"{world_size // ((p.expert_tensor or p.tensor) * p.expert * p.pipeline)}",
    ]
    for name, ranks in groups.items():
        def fmt(group):
            return str(group) if len(group) <= 8 else f"[{', '.join(map(str, group[:4]))}, ..., {group[-1]}] ({len(group)} ranks)"

        shown = ", ".join(fmt(g) for g in ranks[:4]) + (f", ... ({len(ranks)} groups)" if len(ranks) > 4 else "")
        lines.append(f"  {name:<14} groups: {shown}")
    lines += [
        f"memory per GPU (most loaded rank; sequences up to {seq_len} tokens, micro batch {p.micro_batch_size}):",
        f"  parameters  {mem.params_gib:8.2f} GiB",
        f"  gradients   {mem.grads_gib:8.2f} GiB",
        f"  optimizer   {mem.optimizer_gib:8.2f} GiB" + ("  (distributed)" if p.distributed_optimizer else ""),
        f"  activations {mem.activations_gib:8.2f} GiB",
        f"  total       {mem.total_gib:8.2f} GiB of {gpu_memory_gib:.0f} GiB: "
        + ("fits" if mem.total_gib <= 0.9 * gpu_memory_gib else "DOES NOT FIT (keep ~10% headroom)"),
    ]
    return "\n".join(lines)
