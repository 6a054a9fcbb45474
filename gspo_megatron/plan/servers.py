"""The rollout side of ``plan``: what an SGLang server of a model holds per GPU, and how long a weight sync takes.

Estimates from sizes and link rates, not measurements (no GPU has run them). Both read the ``ModelSpec`` the trainer
builds from config.json, so a family's attention decides the KV cache:

- GQA: layers x 2 (K, V) x max(1, kv_heads / attention-TP) x head_dim x bytes per token on each GPU (heads are split
  over attention-TP, replicated once it exceeds them).
- Multi-latent attention (DeepSeek-V3, Kimi-K2): layers x (kv_lora_rank + qk_rope_head_dim) x bytes: SGLang caches
  the compressed latent and the shared rope key (its ``MLATokenToKVPool``), the same on every attention-TP rank, not
  2 x heads x head_dim (DeepSeek-V3: 576 values per layer instead of 2 x 128 x 128 = 32768).

With DP attention (``--attn-dp-size``, SGLang 0.5.23's spelling of ``--dp-size --enable-dp-attention``), each of
the attention-DP groups of tp / attn_dp GPUs runs its own requests with its own cache, so a server holds attn_dp
times one group's tokens; the MoE layers stay spread over all tp GPUs (``--ep-size``: whole experts per GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gspo_megatron.model.hf_config import ModelSpec
from gspo_megatron.plan.memory import GIB, _attention_parameters, model_parameters


def attention_layers(spec: ModelSpec) -> int:
    """Layers that cache keys and values: all but a hybrid's gated-DeltaNet layers."""
    return spec.num_layers - sum(spec.linear_attention_layers)


def kv_cache_bytes_per_token(spec: ModelSpec, attention_tp: int = 1, kv_bytes: int = 2) -> int:
    """Bytes one token's KV cache takes on each GPU of an attention-TP group (``kv_bytes``: 2 bf16, 1 fp8)."""
    if spec.attention == "mla":
        return spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim) * kv_bytes
    heads = max(1, spec.num_key_value_heads // attention_tp)
    return attention_layers(spec) * 2 * heads * spec.head_dim * kv_bytes


def deltanet_state_bytes_per_sequence(spec: ModelSpec, attention_tp: int = 1) -> int:
    """Bytes a hybrid's running sequence holds in its gated-DeltaNet layers on each GPU of an attention-TP group,
    whatever its length (SGLang's mamba pool: the recurrent state [value heads, dk, dv] in fp32, the causal conv's
    last kernel - 1 inputs over q, k, v in bf16)."""
    layers = sum(spec.linear_attention_layers)
    if not layers:
        return 0
    recurrent = spec.linear_num_value_heads * spec.linear_key_head_dim * spec.linear_value_head_dim * 4
    conv_width = 2 * spec.linear_num_key_heads * spec.linear_key_head_dim \
        + spec.linear_num_value_heads * spec.linear_value_head_dim
    conv = conv_width * (spec.linear_conv_kernel_dim - 1) * 2
    return layers * (recurrent + conv) // attention_tp


@dataclass(frozen=True)
class ServerLayout:
    """One SGLang server: ``tp`` GPUs (--tp-size, over --nnodes), ``attn_dp`` attention-DP groups (--attn-dp-size),
    ``ep`` (--ep-size), weights of ``weight_bytes`` per parameter for the linear layers (2 bf16, 1 FP8; embeddings,
    norms and routers stay bf16), a ``kv_bytes`` cache (--kv-cache-dtype), ``mem_fraction_static`` of the GPU for
    weights + KV cache (SGLang chooses ~0.8 on an 80 GB GPU at this size; its rest is activations, CUDA graphs)."""

    tp: int
    attn_dp: int = 1
    ep: int = 1
    weight_bytes: float = 2.0
    kv_bytes: int = 2
    mem_fraction_static: float = 0.8

    @property
    def attention_tp(self) -> int:
        return self.tp // self.attn_dp

    def flags(self) -> str:
        out = f"--tp-size {self.tp}"
        if self.attn_dp > 1:
            out += f" --attn-dp-size {self.attn_dp}"
        if self.ep > 1:
            out += f" --ep-size {self.ep}"
        if self.kv_bytes == 1:
            out += " --kv-cache-dtype fp8_e4m3"
        return out


@dataclass(frozen=True)
class ServerMemory:
    weights_per_gpu: float  # bytes
    kv_per_gpu: float  # bytes left for the KV cache (negative: the weights do not fit)
    kv_bytes_per_token: int  # on each GPU holding the token
    tokens_per_server: float  # KV-cache tokens of the whole server

    @property
    def fits(self) -> bool:
        return self.kv_per_gpu > 0


def server_weights_per_gpu(spec: ModelSpec, layout: ServerLayout) -> float:
    """Bytes of weights on one GPU: routed experts over all tp GPUs (EP x expert-TP = tp), attention over attention-TP
    (MLA's down projections and latent norms replicated), dense MLPs and shared experts over tp, the embedding over
    attention-TP and the output layer over tp (bf16)."""
    h, w = spec.hidden_size, layout.weight_bytes
    split, replicated = _attention_parameters(spec)
    total = spec.num_layers * (split / layout.attention_tp + replicated) * w
    for layer in range(spec.num_layers):
        if spec.is_moe_layer(layer):
            total += (spec.num_experts * 3 * h * spec.moe_ffn_hidden_size + 3 * h * spec.moe_shared_ffn_hidden_size) \
                / layout.tp * w + (spec.num_experts * h + (spec.num_experts if spec.moe_router == "sigmoid" else 0)) * 2
        else:
            total += 3 * h * spec.ffn_hidden_size / layout.tp * w
    vocab = spec.vocab_size * h * 2
    return total + vocab / layout.attention_tp + (0 if spec.tie_embeddings else vocab / layout.tp) + h * 2


def server_memory(spec: ModelSpec, layout: ServerLayout, gpu_memory_gib: float) -> ServerMemory:
    weights = server_weights_per_gpu(spec, layout)
    kv = layout.mem_fraction_static * gpu_memory_gib * GIB - weights
    per_token = kv_cache_bytes_per_token(spec, layout.attention_tp, layout.kv_bytes)
    return ServerMemory(weights_per_gpu=weights, kv_per_gpu=kv, kv_bytes_per_token=per_token,
                        tokens_per_server=max(0.0, kv) / per_token * layout.attn_dp)


@dataclass(frozen=True)
class SyncEstimate:
    """Seconds of one distributed weight sync into SGLang 0.5.23 servers (``rollout/weight_sync.py``)."""

    gigabytes: float  # what every server GPU receives: the whole model
    buckets: int
    wire_s: float  # bytes / link rate into each server GPU
    calls_s: float  # one HTTP update call per bucket
    load_s: tuple[float, float]  # SGLang's load_weights, per tensor

    @property
    def seconds(self) -> tuple[float, float]:
        return tuple(self.wire_s + self.calls_s + load for load in self.load_s)


def weight_sync_estimate(parameters: float, tensors: int, bucket_bytes: int = 256 << 20, bytes_per_parameter: float = 2,
                         link_gb_s: float = 45.0, call_s: float = 0.003,
                         load_per_tensor_s: tuple[float, float] = (20e-6, 50e-6)) -> SyncEstimate:
    """A sync's time from its bytes and links (the model of bench/RESULTS.md, "What it should take on H100s").

    SGLang's ``update_weights_from_distributed`` broadcasts every full tensor to every rank of every server, one update
    call at a time: each server GPU receives the whole model once, at most at its NIC's rate (``link_gb_s``: NDR
    400 Gb/s, ~45 GB/s achieved by NCCL; the broadcast ring pipelines across servers), whatever the number of senders.
    On top: a fixed cost per bucket for the HTTP call and the scheduler's round trip (``call_s``, assumed), and
    ``load_weights`` per tensor (assumed, a range). The gathers onto the senders overlap with sending (not counted)."""
    size = parameters * bytes_per_parameter
    buckets = math.ceil(size / bucket_bytes)
    return SyncEstimate(gigabytes=size / 1e9, buckets=buckets, wire_s=size / (link_gb_s * 1e9),
                        calls_s=buckets * call_s,
                        load_s=(tensors * load_per_tensor_s[0], tensors * load_per_tensor_s[1]))


def fp8_bytes_per_parameter(spec: ModelSpec, scheme) -> float:
    """Bytes per parameter a sync of FP8 rollouts sends (``scheme``: a ``model.fp8.Fp8Scheme``): 1 for each weight
    it quantizes plus that weight's fp32 scales (4 B per block), 2 (bf16) for the rest."""
    from gspo_megatron.model import mapping

    total = parameters = 0
    for name, shape in mapping.hf_tensor_shapes(spec).items():
        numel = math.prod(shape)
        parameters += numel
        if scheme.quantizes(name, shape):
            total += numel + 4 * math.ceil(shape[0] / scheme.block[0]) * math.ceil(shape[1] / scheme.block[1])
        else:
            total += 2 * numel
    return total / parameters


def model_sync_estimate(spec: ModelSpec, bucket_bytes: int = 256 << 20, bytes_per_parameter: float = 2,
                        link_gb_s: float = 45.0) -> SyncEstimate:
    """``weight_sync_estimate`` for a model: its parameters and Hugging Face tensors (what the sync sends)."""
    from gspo_megatron.model import mapping

    tensors = len(mapping.hf_tensor_shapes(spec))
    return weight_sync_estimate(model_parameters(spec)[0], tensors, bucket_bytes, bytes_per_parameter, link_gb_s)
