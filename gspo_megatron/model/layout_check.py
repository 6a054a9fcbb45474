"""Does a parallel layout fit a model? Checked from the ``ModelSpec`` alone, before any process group starts.

Every rule megatron-core would otherwise assert deep inside model construction (or get silently wrong) is
checked here, and the error names the model field, the layout field (megatron-core's names) and the fix.
"""

from __future__ import annotations

import math

from gspo_megatron.environment import transformer_engine_available
from gspo_megatron.parallel.groups import Layout

from .errors import LayoutError
from .hf_config import ModelSpec


def _divisors(n: int) -> str:
    values = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}" if len(values) > 1 else str(values[0])


def _divides(problems: list[str], model_field: str, value: int, layout_field: str, size: int) -> None:
    if size > 1 and value % size:
        problems.append(f"{model_field}={value} is not divisible by {layout_field}={size}: "
                        f"use a {layout_field} that divides {value} ({_divisors(value)})")


def _check_stages(problems: list[str], num_layers: int, layout: Layout) -> None:
    problem = layout.stage_split_problem(num_layers, MEGATRON_STAGE_NAMES)
    if problem:
        problems.append(problem)


MEGATRON_STAGE_NAMES = ("num_hidden_layers", "pipeline_model_parallel_size", "num_layers_in_first_pipeline_stage",
                        "num_layers_in_last_pipeline_stage")


def minimal_world_size(layout: Layout) -> int:
    """The fewest ranks the layout runs on: a multiple of tp*pp*cp (dense) and of ep*etp*pp (experts)."""
    dense = layout.tensor * layout.pipeline * layout.context
    experts = layout.expert * (layout.expert_tensor or layout.tensor) * layout.pipeline
    return dense * experts // math.gcd(dense, experts)


def check_layout(spec: ModelSpec, layout: Layout, world_size: int | None = None, padded_vocab_size: int | None = None,
                 transformer_engine: bool | None = None) -> None:
    """Raise ``LayoutError`` listing every way ``layout`` does not fit ``spec`` (and ``world_size`` if given)."""
    problems: list[str] = []
    tp, pp, ep, cp = layout.tensor, layout.pipeline, layout.expert, layout.context
    etp = layout.expert_tensor or tp
    for name, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                       ("expert_model_parallel_size", ep), ("context_parallel_size", cp),
                       ("expert_tensor_parallel_size", etp)):
        if size < 1:
            problems.append(f"{name}={size} must be >= 1")
    if problems:
        raise LayoutError("parallel layout does not fit the model:\n  - " + "\n  - ".join(problems))

    _divides(problems, "num_attention_heads", spec.num_attention_heads, "tensor_model_parallel_size", tp)
    # Megatron splits whole query groups over TP ranks (it does not replicate KV heads).
    _divides(problems, "num_key_value_heads", spec.num_key_value_heads, "tensor_model_parallel_size", tp)
    if spec.attention == "mla":  # megatron's local spec splits the down projections over TP, then gathers
        if spec.q_lora_rank:
            _divides(problems, "q_lora_rank", spec.q_lora_rank, "tensor_model_parallel_size", tp)
        _divides(problems, "kv_lora_rank + qk_rope_head_dim", spec.kv_lora_rank + spec.qk_rope_head_dim,
                 "tensor_model_parallel_size", tp)
    if spec.dsa_index_topk:
        from .dsa import megatron_problem

        problem = megatron_problem(spec)
        if problem:  # before any other: no layout helps
            raise LayoutError(problem)
        if tp > 1 and not layout.sequence_parallel:  # megatron's AbsorbedMLASelfAttention asserts it
            problems.append(f"sequence_parallel=False with tensor_model_parallel_size={tp}: {spec.family}'s sparse "
                            "attention (megatron-core's AbsorbedMLASelfAttention) needs sequence parallelism under TP; "
                            "set sequence_parallel=True")
        if cp > 1:
            problems.append(f"context_parallel_size={cp}: {spec.family}'s sparse attention is mapped without context "
                            "parallelism (megatron-core's DSA needs cp_comm_type='allgather'); use 1")
    if spec.linear_attention_layers:  # megatron's GatedDeltaNet splits whole key heads (with their value heads)
        _divides(problems, "linear_num_key_heads", spec.linear_num_key_heads, "tensor_model_parallel_size", tp)
        if cp > 1:  # 0.16.1's DeltaNet would run each rank's chunks as if they were whole sequences
            problems.append(f"context_parallel_size={cp}: {spec.family}'s gated-DeltaNet layers are not supported "
                            "under context parallelism here (megatron-core 0.16.1's DeltaNet has none; 0.19.2's "
                            "all-to-all is untested with it): use context_parallel_size=1")
    if spec.has_dense_layers:
        _divides(problems, "intermediate_size", spec.ffn_hidden_size, "tensor_model_parallel_size", tp)
    vocab = padded_vocab_size or spec.padded_vocab_size()
    _divides(problems, "padded vocab_size", vocab, "tensor_model_parallel_size", tp)
    _check_stages(problems, spec.num_layers, layout)

    if spec.is_moe:
        _divides(problems, "num_experts", spec.num_experts, "expert_model_parallel_size", ep)
        _divides(problems, "moe_intermediate_size", spec.moe_ffn_hidden_size, "expert_tensor_parallel_size", etp)
        _divides(problems, "n_shared_experts * moe_intermediate_size", spec.moe_shared_ffn_hidden_size,
                 "tensor_model_parallel_size", tp)
        if spec.linear_bias and etp > 1:  # megatron-core: "Bias in Moe is only supported when ETP==1"
            problems.append(f"expert_tensor_parallel_size={etp}: {spec.family}'s experts have biases, which "
                            "megatron-core splits only with expert_tensor_parallel_size=1 (parallel.expert_tensor=1)")
        if tp > 1 and not layout.sequence_parallel:
            problems.append(f"sequence_parallel=False with tensor_model_parallel_size={tp} on a MoE model: "
                            "megatron-core requires sequence parallelism for MoE under TP; set sequence_parallel=True")
    else:
        if ep > 1:
            problems.append(f"expert_model_parallel_size={ep} but {spec.family} has no experts: use 1")
        if layout.expert_tensor not in (None, tp):
            problems.append(f"expert_tensor_parallel_size={layout.expert_tensor} but {spec.family} has no experts: "
                            "leave it unset")

    if cp > 1:
        te = transformer_engine_available() if transformer_engine is None else transformer_engine
        if not te:
            problems.append(f"context_parallel_size={cp} needs TransformerEngine's attention (megatron-core's local "
                            "attention has no context parallelism): use context_parallel_size=1, or install "
                            "transformer-engine on a GPU machine")
    if world_size is not None:
        problem = layout.world_size_ok(world_size)
        if problem:
            problems.append(f"{problem}: launch a multiple of {minimal_world_size(layout)} ranks")
    if problems:
        raise LayoutError("parallel layout does not fit the model:\n  - " + "\n  - ".join(problems))
