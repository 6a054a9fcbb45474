"""Per-GPU memory of a training rank, counted tensor by tensor from the code it runs (``gspo-megatron plan``).

The count follows megatron-core 0.16.1 (DDP, distributed optimizer, alltoall token dispatcher, SequentialMLP
experts, selective/full recompute) and this package's fused loss, for one rank of a pipeline stage. Every stage
kind is evaluated (first: embedding and the most micro batches in flight; last: output layer, final norm and the
loss) and the most loaded is reported. Sizes per rank: t = TP, x = expert-TP, e = EP, c = CP, p = PP,
d = world / (t*c*p) (dense data-parallel), expert-DP = world / (x*e*p); a = bytes per parameter and activation
(bf16 2, fp32 4).

One module although long: the terms below are one table, each term a short function, and they must be read
(and checked against the measured probe) together.

state (``StageMemory``)
  params     a B per local parameter: attention, dense MLP, embedding / output layer split over t (norms and
             routers replicated), experts over e*x, layers over p.
  grads      4 B per local parameter: DDP's fp32 gradient buffer (optimizer.grad_reduce_in_fp32), or a B without.
  optimizer  Adam's fp32 moments, and an fp32 master copy when parameters are bf16 (8 or 12 B per parameter),
             sharded over d*c (dense) and expert-DP (experts) by the distributed optimizer, and with bf16
             gradients the fp32 copy of them it steps on (4 B more); the share
             optimizer.offload_fraction of it is in host memory instead (``host_optimizer``).
  reference  the frozen KL reference model (algo.kl_coef > 0): a second a-byte copy of the local parameters.
  workspace  (local spec) megatron's global buffer, left at its largest request: the unfused attention's scores.
activations  what autograd keeps for backward per micro batch (``layer_activations``, tensor by tensor, for the
             configured recompute), times the micro batches in flight: 1F1B keeps min(p - stage, micro batches).
             Multi-latent attention (``mla_activations``): the normed q / kv latents, the rope key, and q, k, v at
             heads x (qk_nope + qk_rope) / v_head_dim; shared experts a dense MLP on every token; dense first layers
             (first_k_dense_replace) a dense MLP on the stages that hold them.
             Gated-DeltaNet layers (Qwen3.5, Qwen3-Next: ``deltanet_activations``) keep fla's tensors instead of
             attention's: in_proj's output, the convolved q / k / v, the l2-normed q and k, the decay and beta per
             value head, fla's per-chunk A matrix, the core output and the gated norm's output; their gated full-
             attention layers keep q's output gate as well.
working      the largest transient on top of them, at the point of the step where it occurs: the attention
             core's forward, an MLP or attention block's backward (re-creating what recompute dropped), a
             recomputed chunk's backward, or the fused loss op (last stage). See ``_stage_activations``.
overhead     GPU-only, fixed: the CUDA context with cuBLAS/TE workspaces, NCCL's communicator buffers, and the
             caching allocator's slack (see ``Overhead``).

host memory (``optimizer.offload_fraction`` f > 0 only): megatron's HybridDeviceOptimizer keeps, per offloaded
             element of the rank's optimizer shard, the fp32 master weight and Adam's two moments (pinned) and an fp32
             copy of the gradient it steps on: 16 B, f of the shard (by elements; it offloads whole tensors in order
             until f is reached, so within one tensor of f). Per node: the ranks on it, each with its process's own
             memory (``Overhead.host_process_gib``).

Checked against live tensor bytes of real CPU steps (``memory_probe``, bench/plan_memory.py) for the local spec;
the te tables follow TransformerEngine's code and have not been measured (no GPU).

Tokens: a micro batch is ``b`` rows of the padded length ``s`` (the batcher pads every row to the rollout's longest,
which with hundreds of samples is max_prompt_tokens + max_new_tokens), N = s*b/c per CP rank; under sequence
parallelism the norm / residual regions hold N/t of them. Routed experts receive k*x*N/t tokens per rank (each rank
routes its N/t tokens to k experts; the all-to-all over e spreads them evenly on average, the expert-TP all-gather
multiplies by x), not N*k/(e*x).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gspo_megatron.model.hf_config import ModelSpec
from gspo_megatron.parallel.groups import Layout
from gspo_megatron.train.startup.config import Config

GIB = 1024**3
IMPLEMENTATIONS = ("te", "local")
"""te: TransformerEngine's layer spec (fused norm+linear, flash/fused attention): what a GPU run builds.
local: megatron-core's local spec (torch RMSNorm, unfused attention): what runs on CPU (and on a GPU without TE)."""


@dataclass(frozen=True)
class Overhead:
    """GPU memory outside the tensors ``plan`` counts. Estimates, not measurements (no GPU here):

    - cuda_context_gib: the CUDA context of one process on an H100 with CUDA 12's lazy module loading (~0.5 GiB),
      plus cuBLAS workspaces (32 MiB per handle and stream on Hopper) and TransformerEngine's own 32 MiB workspace.
    - nccl_gib: NCCL communicators. Each connection keeps NCCL_BUFFSIZE (default 4 MiB) per channel and peer, and
      megatron builds ~10 groups per rank (TP, PP, DP, DP x CP, EP, expert-TP, expert-DP, TP x EP, model-parallel,
      embedding), created on first use; NVLink SHARP (NVSwitch H100 systems) adds its own buffers
      (NCCL_NVLS_ENABLE=0 trades them for bandwidth).
    - allocator_slack: PyTorch's caching allocator reserves more than it hands out; with
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (examples/launch_cluster.sh) fragmentation stays small.
    - host_process_gib: with the optimizer offloaded, each rank's process's own host memory beside the offloaded
      state (Python, torch and CUDA's host side, NCCL's host buffers, a safetensors shard being read): an allowance.
    """

    cuda_context_gib: float = 1.0
    nccl_gib: float = 2.0
    allocator_slack: float = 0.05  # of the tensors' peak
    host_process_gib: float = 8.0


@dataclass
class Micro:
    """One micro batch on one rank, and the sizes the activation terms need."""

    s: int  # padded sequence length (columns of the micro batch)
    b: int  # sequences
    tp: int
    sp: int  # split of the norm / residual regions: tp under sequence parallelism, else 1
    cp: int
    etp: int
    a: int  # bytes per activation element

    @property
    def tokens(self) -> float:
        """N: tokens of the micro batch on this CP rank."""
        return self.s * self.b / self.cp


def _norm(m: Micro, h: int, impl: str) -> float:
    """An RMSNorm over [N/sp, h], what backward keeps of it and of its output (the next linear's input).

    te: TE's fused norm (+linear) saves its input and output (a B each) and rsigma (fp32).
    local: torch's RMSNorm upcasts (the fp32 input, itself when a = 4), keeps the normalised fp32 tensor and
    rstd; the output in a B is the linear's input."""
    per_token = 2 * m.a * h + 4 if impl == "te" else 8 * h + m.a * h + 4
    return m.tokens / m.sp * per_token


def qkv_widths(spec: ModelSpec) -> tuple[int, int, int]:
    """Elements per token, all heads, of the query, key and value the attention core receives.

    GQA: heads x d, kv_heads x d, kv_heads x d. Multi-latent attention: the up projections give every head its own
    key, so heads x (qk_nope + qk_rope) for q and k (k's rope part, shared by the heads, expanded) and
    heads x v_head_dim for v."""
    n = spec.num_attention_heads
    if spec.attention == "mla":
        return n * spec.head_dim, n * spec.head_dim, n * spec.v_head_dim
    return n * spec.head_dim, spec.num_key_value_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim


def mla_activations(spec: ModelSpec, m: Micro, impl: str, recompute: frozenset) -> dict[str, float]:
    """Bytes one multi-latent attention block (megatron's MLASelfAttention) keeps for backward, per micro batch.

    Down projections on the norm's output ([N/sp, h]): q to q_lora_rank (none without q LoRA: one q_proj), kv to
    kv_lora_rank + qk_rope (the shared rope key); each latent normed, then up-projected per head (TP-split):
    q to heads x (qk_nope + qk_rope), kv to heads x (qk_nope + v). RoPE rotates the rope parts; q, k (the rope
    key expanded to every head) and v are made contiguous for the core, which keeps them; then softmax as GQA."""
    t, a = m.tp, m.a
    heads = spec.num_attention_heads / t
    n = m.tokens / t  # tokens x (this rank's heads) / heads
    q_w, k_w, v_w = qkv_widths(spec)
    out: dict[str, float] = {"input_norm": _norm(m, spec.hidden_size, impl)}
    # Each latent's RMSNorm over [N/sp, rank] and the up projection's input (TE fuses the norm into the up projection,
    # TELayerNormColumnParallelLinear, which saves the same tensors).
    latents = _norm(m, spec.kv_lora_rank, impl)
    if spec.q_lora_rank:
        latents += _norm(m, spec.q_lora_rank, impl)
    # The rope key [N, 1, qk_rope] (gathered under sequence parallelism), kept by the rotation.
    latents += m.tokens * a * spec.qk_rope_head_dim
    out["mla_latents"] = latents
    # RoPE's cos and sin tables [s, 1, 1, qk_rope] for q and for k, built per call (none with TE's fused MLA rope).
    if impl == "local":
        out["rope_tables"] = 4 * (m.s / m.cp) * spec.qk_rope_head_dim * a
    if impl == "te" or "core_attn" in recompute:
        # The core's inputs, contiguous q, k, v: flash attention's saved tensors, or a core_attn checkpoint's inputs.
        out["qkv"] = n * a * (q_w + k_w + v_w)
    if impl == "te":
        # Its output, and the softmax log-sum-exp (fp32, per token and head of this rank).
        out["context"] = n * a * v_w + (0 if "core_attn" in recompute else m.tokens * heads * 4)
        return out
    if "core_attn" not in recompute:
        # model.mla.LocalMLAAttention (fp32 einsums): the fp32 copies of q, k, v, the fp32 probabilities and the
        # [s, s] causal mask (bool).
        out["q_k_v_bmm"] = n * 4 * (q_w + k_w + v_w)
        out["softmax"] = _scores(spec, m) * 4
        out["causal_mask"] = (m.s / m.cp) ** 2
    out["context"] = n * a * v_w  # the out-projection's input
    return out


def attention_activations(spec: ModelSpec, m: Micro, impl: str, recompute: frozenset) -> dict[str, float]:
    """Bytes one attention block keeps for backward, per micro batch, by tensor. An output gate (Qwen3.5's gated
    attention) keeps its half of q_proj's output and the gated context beside the context."""
    if spec.attention == "mla":
        return mla_activations(spec, m, impl, recompute)
    out = _gqa_activations(spec, m, impl, recompute)
    if spec.attention_output_gate:
        out["output_gate"] = 2 * m.tokens / m.tp * m.a * spec.num_attention_heads * spec.head_dim
    return out


def _gqa_activations(spec: ModelSpec, m: Micro, impl: str, recompute: frozenset) -> dict[str, float]:
    d, t = spec.head_dim, m.tp
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    heads = spec.num_attention_heads / t
    n, a = m.tokens / t, m.a  # tokens x (this rank's heads) in the attention region
    out: dict[str, float] = {"input_norm": _norm(m, spec.hidden_size, impl)}
    # RoPE's cos and sin tables [s, 1, 1, d] for q and for k, built per call.
    out["rope_tables"] = 4 * (m.s / m.cp) * d * a
    if impl == "te":
        # The fused QKV output: value is a view of it, which the attention keeps.
        out["qkv"] = n * a * (q + 2 * kv)
        if spec.qk_norm:  # TENorm keeps a contiguous copy of its input and rsigma
            out["qk_norm"] = n * (a * (q + kv) + 4 * (heads + spec.num_key_value_heads / t))
        out["q_k_rotated"] = n * a * (q + kv)  # flash attention's saved q and k
        # Its output (also the out-projection's input) and the softmax log-sum-exp (fp32, per head; recomputed
        # inside a core_attn checkpoint).
        out["context"] = n * a * q + (0 if "core_attn" in recompute else m.tokens * heads * 4)
        return out
    if spec.qk_norm:  # torch RMSNorm per head: fp32 input and normalised tensor, rstd
        rstd = 4 * (heads + spec.num_key_value_heads / t)
        if a == 4:  # the fp32 "upcast" is the input itself: q a reshaped copy, k a view of the QKV output
            out["qkv"] = n * a * (q + 2 * kv)
            out["qk_norm"] = n * (4 * q + 4 * (q + kv) + rstd)
        else:
            out["qk_norm"] = n * (8 * (q + kv) + rstd)
    if "core_attn" in recompute:
        # The checkpoint keeps its inputs: rotated q and k, and value, a view of the QKV output.
        out["q_k_rotated"] = n * a * (q + kv)
        out["qkv"] = n * a * (q + 2 * kv)
    else:
        # Unfused attention: q and the GQA-expanded k and v as bmm operands, the fp32 softmax output and its
        # cast to a (the same tensor when a = 4), the [s, s] causal mask.
        out["q_k_v_bmm"] = n * a * 3 * q
        out["softmax"] = _scores(spec, m) * (4 + (a if a != 4 else 0))
        out["causal_mask"] = (m.s / m.cp) ** 2
    out["context"] = n * a * q  # the out-projection's input
    return out


CHUNK = 64  # fla's chunk of the gated delta rule: one recurrent state per 64 tokens in its forward and backward


def _deltanet_widths(spec: ModelSpec) -> tuple[int, int, int]:
    """(q or k width, v width, value heads) of a gated-DeltaNet layer, all heads."""
    return (spec.linear_num_key_heads * spec.linear_key_head_dim,
            spec.linear_num_value_heads * spec.linear_value_head_dim, spec.linear_num_value_heads)


def deltanet_activations(spec: ModelSpec, m: Micro, impl: str, recompute: frozenset) -> dict[str, float]:
    """Bytes one gated-DeltaNet block (megatron's GatedDeltaNet on fla's kernels) keeps for backward, per micro batch.

    Heads split over TP ([N, width / t] per rank): in_proj's output [q; k; v; z; b; a] (z is the output gate, b and
    a feed beta and the decay), the causal conv's output over q, k, v (after SiLU), the l2-normed q and k, the decay
    g (fp32) and beta per value head, fla's per-chunk A = (I + tril(beta k k^T))^-1 ([N, heads, 64]), the core's
    output and the gated norm's output (out_proj's input) with its rstd. The local spec runs ops/gated_delta_rule's
    torch rule instead: counted the same (not measured)."""
    qk, v, heads = _deltanet_widths(spec)
    n, a = m.tokens / m.tp, m.a
    out: dict[str, float] = {"input_norm": _norm(m, spec.hidden_size, impl)}
    out["in_proj"] = n * a * (2 * qk + 2 * v + 2 * heads)
    out["conv"] = n * a * (2 * qk + v)
    out["qk_l2norm"] = n * (a * 2 * qk + 4 * 2 * spec.linear_num_key_heads)
    out["decay_beta"] = n * heads * (2 * 4 + a)  # softplus(a + dt_bias) and g in fp32, sigmoid(b)
    out["chunk_A"] = n * heads * CHUNK * a
    out["core_out"] = n * a * v
    out["gated_norm"] = n * (a * v + 4 * heads)  # its output, the out-projection's input, and rstd
    return out


def deltanet_transients(spec: ModelSpec, m: Micro) -> tuple[float, float]:
    """(forward, backward) peak bytes inside the gated delta rule beyond the block's saved tensors: the recurrent
    state at every chunk boundary, [N / 64, heads / t, dk, dv] in the activations' dtype (fla keeps h per chunk for
    the output; backward recomputes it beside its gradient dh), with the WY factors w and u ([N, heads / t, dk + dv])
    forward and the q, k, v, g, beta gradients backward."""
    qk, v, heads = _deltanet_widths(spec)
    n, a = m.tokens / m.tp, m.a
    states = m.tokens / CHUNK * heads / m.tp * spec.linear_key_head_dim * spec.linear_value_head_dim * a
    wy = n * a * heads * (spec.linear_key_head_dim + spec.linear_value_head_dim)
    grads = n * (a * (2 * qk + v + heads) + 4 * heads)
    return states + wy, 2 * states + wy + grads


def mixer_activations(spec: ModelSpec, m: Micro, impl: str, recompute: frozenset, linear: bool) -> dict[str, float]:
    """A layer's token mixer: a gated-DeltaNet block where ``linear``, else the attention block."""
    if linear:
        return deltanet_activations(spec, m, impl, recompute)
    return attention_activations(spec, m, impl, recompute)


def mlp_activations(spec: ModelSpec, m: Micro, impl: str, recompute: frozenset, moe: bool) -> dict[str, float]:
    """Bytes one MLP block (dense or routed experts) keeps for backward, per micro batch, by tensor."""
    out: dict[str, float] = {"pre_mlp_norm": _norm(m, spec.hidden_size, impl)}
    # megatron's GLU in python, experts and dense alike: fc1's output (2f; silu's input), silu(x), the linear half
    # plus glu_linear_offset (a new tensor), their product (fc2's input, or the probs-weighted copy's input).
    if not moe:
        if "mlp" not in recompute:
            out["mlp"] = m.tokens / m.tp * m.a * 5 * spec.ffn_hidden_size
        return out
    if "moe" in recompute:  # the checkpoint keeps the layer's input: the norm's output, counted above
        return out
    if spec.moe_shared_ffn_hidden_size:  # always-on experts: a dense GLU MLP (TP-split) on every token
        out["shared_experts"] = m.tokens / m.tp * m.a * 5 * spec.moe_shared_ffn_hidden_size
    k, experts, f = spec.moe_topk, spec.num_experts, spec.moe_ffn_hidden_size
    local = m.tokens / m.sp
    # Router, per local token: top-k indices (int64) and probs (fp32), the routing map (bool) and probs map (a),
    # the permutation's sorted indices (int64) and the permuted probs (a).
    out["router"] = local * (k * (8 + 4 + 8 + m.a) + experts * (1 + m.a))
    routed = k * m.etp * local  # tokens this rank's experts receive (balanced routing)
    out["routed_tokens"] = routed * m.a * spec.hidden_size  # dispatched, sorted by expert: fc1's input
    # Per routed token: fc1's output (2f), silu (f), linear half + offset (f), GLU (f), GLU x prob (f: fc2's input).
    out["experts"] = routed * m.a * 6 * f / m.etp
    return out


def layer_activations(spec: ModelSpec, m: Micro, impl: str, recompute: frozenset, moe: bool,
                      linear: bool = False) -> dict[str, float]:
    """One transformer layer's saved tensors (bytes per micro batch) under selective ``recompute`` modules; ``linear``:
    its mixer is a gated-DeltaNet block."""
    return {**mixer_activations(spec, m, impl, recompute, linear),
            **{f"mlp.{k}": v for k, v in mlp_activations(spec, m, impl, recompute, moe).items()}}


def _scores(spec: ModelSpec, m: Micro) -> float:
    """Elements of one micro batch's attention scores on this rank: b x heads/t x s x s."""
    return m.b * spec.num_attention_heads / m.tp * (m.s / m.cp) ** 2


def attention_transients(spec: ModelSpec, m: Micro, impl: str) -> tuple[float, float]:
    """(forward, backward) peak bytes inside an attention core beyond the block's other saved tensors.

    local forward: the baddbmm scores (a), their fp32 copy (the same tensor when a = 4), the fp32 softmax and its
    cast to a (none when a = 4): 12 B (bf16) / 8 B (fp32) per score. local backward, at the softmax's backward:
    its saved fp32 output, the probabilities' gradient in fp32, the input gradient, and with fp32 activations one
    more fp32 temporary of torch's CPU kernel: 12 B / 16 B per score (measured with ``memory_probe`` around
    megatron's DotProductAttention, torch 2.13); then q, k, v gradients. te (flash attention): nothing [s, s];
    backward holds the q, k, v and QKV-output gradients."""
    a = m.a
    qkv_grads = m.tokens / m.tp * a * sum(qkv_widths(spec))
    if impl == "local" and spec.attention == "mla":
        # LocalMLAAttention (measured around it, torch 2.13): forward, the fp32 scores, their masked copy and the
        # probabilities (12 B per score); backward, the probabilities' and scores' fp32 gradients beside the saved
        # probabilities (8 B), then fp32 and a-byte q, k, v gradients.
        scores = _scores(spec, m)
        return scores * 12, scores * 8 + qkv_grads * (1 + 4 / a)
    if impl == "local":
        scores = _scores(spec, m)
        forward = scores * (a + 4 + (4 + a if a != 4 else 0))
        return forward, scores * (16 if a == 4 else 12) + qkv_grads
    return 0.0, 2 * qkv_grads


def mlp_gradients(spec: ModelSpec, m: Micro, moe: bool) -> float:
    """Bytes of gradients an MLP block's backward holds at once (its forward's transients are no larger): for
    experts, the routed tokens' gradient and the expert outputs being combined ([k*x*N/t, h] each); for a dense
    MLP, fc1's output gradient and the block's input gradient."""
    h = spec.hidden_size
    if moe:  # (+ the shared experts' fc1 output gradient)
        return (2 * m.a * spec.moe_topk * m.etp * m.tokens / m.sp * h
                + m.a * m.tokens / m.tp * 2 * spec.moe_shared_ffn_hidden_size)
    return m.a * (m.tokens / m.tp * 2 * spec.ffn_hidden_size + m.tokens / m.sp * h)


def fused_loss_buffers(spec: ModelSpec, m: Micro, padded_vocab: int, entropy: bool) -> float:
    """Peak bytes of ``ops.sequence_loss``'s forward on the last stage (its backward holds less): the gathered
    hidden states (a), their fp32 copy, the fp32 copy of the weight shard (bf16 weights only), the fp32 hidden and
    weight gradients it accumulates, and one (two with the entropy bonus) fp32 [chunk, V/t] logits buffer."""
    from gspo_megatron.ops.logprob import auto_chunk_size

    h, tokens = spec.hidden_size, m.tokens
    shard = padded_vocab / m.tp
    chunk = auto_chunk_size(spec.vocab_size // m.tp)
    rows = (min(m.b, chunk // m.s) * m.s) if m.s <= chunk else chunk
    weight_copy = 4 * shard * h if m.a != 4 else 0
    return (tokens * h * (m.a + 4 + 4) + weight_copy + 4 * shard * h
            + 4 * rows * shard * (2 if entropy else 1))


@dataclass
class StageMemory:
    """One rank of one pipeline stage, in bytes (``gib`` for GiB)."""

    stage: str
    params: float
    grads: float
    optimizer: float
    reference: float
    activations: float
    working: float
    micro_batches_in_flight: int
    activation_terms: dict = field(default_factory=dict)  # one micro batch, all its layers, by tensor
    working_what: str = ""
    workspace: float = 0.0  # buffers the first step leaves allocated (megatron's global buffer, local spec)
    host_optimizer: float = 0.0  # the offloaded optimizer state in host memory (optimizer.offload_fraction)

    @property
    def state(self) -> float:
        """What stays allocated between steps."""
        return self.params + self.grads + self.optimizer + self.reference + self.workspace

    @property
    def tensors(self) -> float:
        """The allocator's peak: everything ``torch.cuda.max_memory_allocated`` would count."""
        return self.state + self.activations + self.working


@dataclass
class MemoryEstimate:
    stages: list[StageMemory]
    overhead: Overhead
    impl: str
    seq_len: int
    micro_batches: int  # per minibatch per data-parallel rank
    notes: list[str]

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda st: st.tensors)

    @property
    def slack_bytes(self) -> float:
        return self.overhead.allocator_slack * self.worst.tensors

    @property
    def fixed_bytes(self) -> float:
        return (self.overhead.cuda_context_gib + self.overhead.nccl_gib) * GIB

    @property
    def total_bytes(self) -> float:
        """Per-GPU total: the tensors' peak, allocator slack and the fixed overhead."""
        return self.worst.tensors + self.slack_bytes + self.fixed_bytes

    @property
    def host_optimizer(self) -> float:
        """The offloaded optimizer state of one rank in host memory: the stage that offloads most."""
        return max(st.host_optimizer for st in self.stages)

    def host_bytes_per_node(self, gpus_per_node: int) -> float:
        """Host memory a node needs for the offloaded optimizer state: its ranks (each counted as the stage that
        offloads most) with their processes' allowance. 0 without offload."""
        if not self.host_optimizer:
            return 0.0
        return gpus_per_node * (self.host_optimizer + self.overhead.host_process_gib * GIB)


def padded_length(cfg: Config) -> int:
    """Columns of every micro batch: the longest possible row (prompt + response), padded as the loop pads
    (``rollout.batch.samples_to_batch``, a multiple of parallel.tensor). A multi-turn trajectory's response is up
    to ``rollout.max_trajectory_tokens`` (turns and observations)."""
    r = cfg.rollout
    s = r.max_prompt_tokens + (r.max_trajectory_tokens if r.env else r.max_new_tokens)
    multiple = cfg.parallel.tensor * (2 * cfg.parallel.context if cfg.parallel.context > 1 else 1)
    return -(-s // multiple) * multiple


def micro_batches_per_step(cfg: Config, world_size: int) -> int:
    """Micro batches per minibatch per data-parallel rank (with a token budget: at most one per sequence)."""
    p = cfg.parallel
    dp = world_size // (p.tensor * p.pipeline * p.context)
    per_minibatch = cfg.rollout.prompts_per_step * cfg.rollout.group_size // cfg.algo.minibatches
    sequences = 1 if p.max_tokens_per_micro_batch else p.micro_batch_size
    return max(1, per_minibatch // (dp * sequences))


def _attention_parameters(spec: ModelSpec) -> tuple[int, int]:
    """(split over TP, replicated) parameters of one layer's attention and its two norms (input, pre-MLP).

    GQA: q/k/v/o projections (+ qkv biases) split, q/k norms replicated (MiniMax-M2's whole-projection ones split). Multi-latent attention (DeepSeek-V3): the
    q / kv up projections and the output projection split; the down projections and the latent norms replicated (TE's
    duplicated linears; megatron's local spec splits the down projections, then gathers them)."""
    h, d = spec.hidden_size, spec.head_dim
    norms = 2 * h
    if spec.attention == "mla":
        heads, rope, kv_lora, q_lora = spec.num_attention_heads, spec.qk_rope_head_dim, spec.kv_lora_rank, spec.q_lora_rank
        q = heads * d
        split = (q_lora * q if q_lora else h * q) + kv_lora * heads * (d - rope + spec.v_head_dim) \
            + heads * spec.v_head_dim * h
        replicated = norms + (h * q_lora + q_lora if q_lora else 0) + h * (kv_lora + rope) + kv_lora
        if spec.dsa_index_topk:  # the sparse attention's indexer, whole on every TP rank (wq_b, wk, k_norm, weights)
            index_q, index_d = spec.dsa_index_heads * spec.dsa_index_head_dim, spec.dsa_index_head_dim
            replicated += q_lora * index_q + h * index_d + 2 * index_d + h * spec.dsa_index_heads
        return split, replicated
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    split = h * q + 2 * h * kv + q * h + (q + 2 * kv if spec.qkv_bias else 0)
    split += spec.num_attention_heads if spec.attention_sinks else 0  # a sink logit per head
    if spec.qk_norm_whole_projection:  # MiniMax-M2: q/k norms over the whole projection, split with the heads
        return split + q + kv, norms + (h if spec.linear_bias else 0)
    return split, norms + (2 * d if spec.qk_norm else 0) + (h if spec.linear_bias else 0)  # o_proj's bias


def _linear_attention_parameters(spec: ModelSpec) -> tuple[int, int]:
    """(split over TP, replicated) parameters of one gated-DeltaNet layer and its two norms: in_proj's q, k, v, z, b, a
    rows, the depthwise conv over q, k, v (no bias), A_log and dt_bias per value head and out_proj split; the gated
    norm (one value head wide) replicated."""
    h = spec.hidden_size
    qk, v, heads = _deltanet_widths(spec)
    conv = 2 * qk + v
    split = h * (conv + v + 2 * heads) + conv * spec.linear_conv_kernel_dim + 2 * heads + v * h
    return split, 2 * h + spec.linear_value_head_dim


def _mixer_parameters(spec: ModelSpec, layer: int) -> tuple[int, int]:
    """(split over TP, replicated) parameters of a layer's token mixer and its two norms."""
    if spec.is_linear_attention_layer(layer):
        return _linear_attention_parameters(spec)
    split, replicated = _attention_parameters(spec)
    if spec.attention_output_gate:  # q_proj also emits the gate: heads x d more rows
        split += spec.hidden_size * spec.num_attention_heads * spec.head_dim
    return split, replicated


def _moe_replicated(spec: ModelSpec) -> int:
    """The router (and the sigmoid router's expert bias, or its linear's bias, or the shared expert's gate) of one
    MoE layer."""
    return spec.num_experts * spec.hidden_size + (spec.num_experts if spec.moe_router == "sigmoid" else 0) \
        + (spec.num_experts if spec.linear_bias else 0) + (spec.hidden_size if spec.moe_shared_expert_gate else 0)


def _expert_parameters(spec: ModelSpec) -> int:
    """One routed expert: gate, up and down projections (and their biases: gpt-oss)."""
    h, ffn = spec.hidden_size, spec.moe_ffn_hidden_size
    return 3 * h * ffn + (2 * ffn + h if spec.linear_bias else 0)


def model_parameters(spec: ModelSpec) -> tuple[int, int]:
    """(total, active per token) parameters of the model, unpadded vocabulary (MTP layers not counted: never built)."""
    h = spec.hidden_size
    total = active = spec.vocab_size * h * (1 if spec.tie_embeddings else 2) + h
    for layer in range(spec.num_layers):
        total += sum(_mixer_parameters(spec, layer))
        active += sum(_mixer_parameters(spec, layer))
        if spec.is_moe_layer(layer):
            expert, shared = _expert_parameters(spec), 3 * h * spec.moe_shared_ffn_hidden_size
            total += spec.num_experts * expert + shared + _moe_replicated(spec)
            active += spec.moe_topk * expert + shared + _moe_replicated(spec)
        else:
            total += 3 * h * spec.ffn_hidden_size
            active += 3 * h * spec.ffn_hidden_size
    return total, active


def stage_layers(spec: ModelSpec, cfg: Config, stage: int) -> range:
    """The global layer numbers of pipeline ``stage`` (even, or ``parallel.first/last_stage_layers``)."""
    return Layout.of(cfg.parallel).stage_range(spec.num_layers, stage)


def parameter_counts(spec: ModelSpec, cfg: Config, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters held by one rank of pipeline ``stage``."""
    p = cfg.parallel
    t, pp = p.tensor, p.pipeline
    etp = p.expert_tensor or t
    h = spec.hidden_size
    layers = stage_layers(spec, cfg, stage)
    vocab = spec.padded_vocab_size()
    split = replicated = experts = 0.0
    for layer in layers:
        mixer_split, mixer_replicated = _mixer_parameters(spec, layer)
        split += mixer_split
        replicated += mixer_replicated
        if spec.is_moe_layer(layer):
            replicated += _moe_replicated(spec)
            split += 3 * h * spec.moe_shared_ffn_hidden_size  # shared experts: split over TP like a dense MLP
            experts += spec.num_experts * _expert_parameters(spec) / (p.expert * etp)
        else:
            split += 3 * h * spec.ffn_hidden_size
    first, last = stage == 0, stage == pp - 1
    if first:
        split += vocab * h
    if last:
        replicated += h  # final norm
        if not spec.tie_embeddings or pp > 1:  # the output layer (a tied one has its own copy on the last stage)
            split += vocab * h
    return split / t + replicated, experts


@dataclass
class State:
    """What stays allocated between steps on one rank, in bytes: on its GPU, and the offloaded optimizer's in host
    memory."""

    params: float
    grads: float
    optimizer: float
    reference: float
    host_optimizer: float


def _state(cfg: Config, dense: float, experts: float, world_size: int) -> State:
    p = cfg.parallel
    a = 2 if cfg.model.dtype == "bfloat16" else 4
    etp = p.expert_tensor or p.tensor
    dp_cp = world_size // (p.tensor * p.pipeline)  # the distributed optimizer shards dense state over DP x CP
    edp = world_size // (etp * p.expert * p.pipeline)
    params = (dense + experts) * a
    grads = (dense + experts) * (4 if cfg.optimizer.grad_reduce_in_fp32 else a)
    per_param = 12 if a == 2 else 8  # (fp32 master +) exp_avg + exp_avg_sq
    if a < 4 and not cfg.optimizer.grad_reduce_in_fp32:
        per_param += 4  # the fp32 copy of its bf16 gradient that the optimizer steps on (kept until zero_grad)
    shard = dense / dp_cp + experts / edp if p.distributed_optimizer else dense + experts
    f = cfg.optimizer.offload_fraction
    # Offloaded: fp32 master, exp_avg, exp_avg_sq and the fp32 gradient copy the CPU's Adam steps on.
    host = f * shard * 16
    reference = params if cfg.algo.kl_coef > 0 else 0.0
    return State(params, grads, (1 - f) * per_param * shard, reference, host)


def _split(terms: dict[str, float]) -> tuple[float, float]:
    """(attention block, MLP block) bytes of a ``layer_activations`` dict."""
    mlp = sum(v for k, v in terms.items() if k.startswith("mlp."))
    return sum(terms.values()) - mlp, mlp


def _stage_activations(spec: ModelSpec, cfg: Config, m: Micro, stage: int, impl: str):
    """(saved bytes of one micro batch by tensor, the working set above them, what the working set is).

    The peak of a step is at one of a few points of the last micro batch's last layers (all earlier layers' tensors
    saved): the attention core's forward, an MLP block's forward or backward, an attention block's backward (its
    MLP block's tensors already freed), or the loss. Recompute re-creates what it dropped when that block runs
    backward; full recompute re-creates whole chunks of layers."""
    r = cfg.recompute
    layers = list(stage_layers(spec, cfg, stage))
    selective = frozenset(r.modules) if r.granularity == "selective" else frozenset()
    input_bytes = m.tokens / m.sp * m.a * spec.hidden_size  # a layer's input (and its output gradient)
    transients = {False: attention_transients(spec, m, impl)}  # (forward, backward) of the mixer's core
    if spec.linear_attention_layers:
        transients[True] = deltanet_transients(spec, m)
    terms: dict[str, float] = {}

    def add(layer_terms: dict[str, float]) -> None:
        for name, value in layer_terms.items():
            terms[name] = terms.get(name, 0.0) + value

    def kind(layer: int) -> tuple[bool, bool]:
        """(MoE, gated-DeltaNet): what a layer's saved tensors depend on."""
        return spec.is_moe_layer(layer), spec.is_linear_attention_layer(layer)

    kinds = sorted({kind(i) for i in layers})
    last_stage = stage == cfg.parallel.pipeline - 1
    last_norm = _norm(m, spec.hidden_size, impl) if last_stage else 0.0
    full = {k: layer_activations(spec, m, impl, frozenset(), *k) for k in kinds}

    def layer_peaks(kept: dict[str, float], k: tuple[bool, bool]) -> list[tuple[float, str]]:
        """Peaks while the stage's last layer runs, above everything saved (``kept`` being its own tensors):
        the attention core's forward (its own and later tensors not there yet), an MLP block's backward
        (re-creating what recompute dropped), an attention block's backward (the MLP block's tensors freed, the
        [s, s] softmax part of the core's peak). The final norm's tensors exist in none of them. A gated-DeltaNet
        layer's core is the delta rule (its recurrent states)."""
        moe, linear = k
        core_fwd, core_bwd = transients[linear]
        kept_attn, kept_mlp = _split(kept)
        full_attn, full_mlp = _split(full[k])
        after_core = sum(kept.get(name, 0.0) for name in ("softmax", "causal_mask", "context", "core_out",
                                                          "gated_norm"))
        remat_attn = (full_attn - full[k].get("softmax", 0.0)) - (kept_attn - kept.get("softmax", 0.0))
        core = "the delta rule's" if linear else "the attention core's"
        return [
            (core_fwd - kept_mlp - after_core - last_norm, f"{core} forward"),
            (full_mlp - kept_mlp + mlp_gradients(spec, m, moe) - last_norm, "an MLP block's backward"),
            (remat_attn + core_bwd - kept.get("softmax", 0.0) - kept_mlp - last_norm,
             "a gated-DeltaNet block's backward" if linear else "an attention block's backward"),
        ]

    candidates: list[tuple[float, str]] = []
    if r.granularity == "full":
        # megatron keeps each recomputed chunk's input; block recomputes the first num_layers layers of the
        # stage and keeps the rest whole; uniform recomputes every chunk of num_layers layers. A chunk's
        # backward first re-runs its forward, keeping everything, then goes back through it.
        recomputed = layers[: r.num_layers] if r.method == "block" else layers
        group = r.num_layers if r.method == "uniform" else 1
        terms["recompute_inputs"] = math.ceil(len(recomputed) / group) * input_bytes
        for i in layers[len(recomputed):]:
            add(full[kind(i)])
            candidates += layer_peaks(full[kind(i)], kind(i))
        kept_after = sum(sum(full[kind(i)].values()) for i in layers[len(recomputed):])
        for j in range(0, len(recomputed), group):
            chunk = recomputed[j:j + group]
            redo = sum(sum(full[kind(i)].values()) for i in chunk)
            # Layers after the chunk went backward before it: their tensors (or chunk inputs) are freed.
            freed = kept_after + (len(recomputed) - j - len(chunk)) // group * input_bytes
            last = kind(chunk[-1])
            candidates += [(redo - freed + value, "a recomputed chunk's backward")
                           for value, _ in layer_peaks(full[last], last)]
        # A recomputed chunk's first forward keeps nothing but transients; the whole layers after it do not exist yet.
        candidates += [(transients[linear][0] - kept_after - last_norm, "the attention core's forward")
                       for _, linear in kinds]
    else:
        for i in layers:
            add(layer_activations(spec, m, impl, selective, *kind(i)))
        for k in kinds:
            candidates += layer_peaks(layer_activations(spec, m, impl, selective, *k), k)
    if last_stage:
        terms["final_norm"] = last_norm
        loss = fused_loss_buffers(spec, m, spec.padded_vocab_size(), cfg.algo.entropy_coef > 0)
        candidates.append((loss, "the fused loss op"))
    working, what = max(candidates)
    return terms, max(0.0, working), what


def estimate_memory(spec: ModelSpec, cfg: Config, world_size: int, seq_len: int | None = None,
                    impl: str = "te", overhead: Overhead = Overhead()) -> MemoryEstimate:
    """The per-GPU memory of training ``cfg`` on ``world_size`` ranks, every pipeline stage kind evaluated.

    ``seq_len``: the micro batches' padded length (default: ``padded_length(cfg)``, what the loop produces). With
    ``parallel.pack_sequences`` a micro batch is one row of ``micro_batch_size`` such lengths (an upper bound), or
    with a token budget the budget (or one sequence of ``seq_len``, if longer).
    ``impl``: te (GPU) or local (megatron's local spec, what CPU runs build; see IMPLEMENTATIONS).
    """
    from gspo_megatron.train.startup.validate import validate_layout

    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLEMENTATIONS}")
    validate_layout(cfg, world_size)
    p = cfg.parallel
    s = seq_len or padded_length(cfg)
    a = 2 if cfg.model.dtype == "bfloat16" else 4
    sp = p.tensor if (p.sequence_parallel and p.tensor > 1) else 1
    b = p.micro_batch_size
    if p.pack_sequences:  # one row per micro batch (attention over the whole row): b rows of s, or the budget
        s, b = (max(s, -(-p.max_tokens_per_micro_batch // sp) * sp) if p.max_tokens_per_micro_batch else b * s), 1
    m = Micro(s=s, b=b, tp=p.tensor, sp=sp, cp=p.context, etp=p.expert_tensor or p.tensor, a=a)
    micro = micro_batches_per_step(cfg, world_size)
    # Evenly split, the first stage is the most loaded of the middle ones (the same layers, more micro batches in
    # flight); uneven, the first middle stage is a kind of its own
    uneven = p.first_stage_layers is not None or p.last_stage_layers is not None
    kinds = sorted({0, p.pipeline - 1} | ({1} if uneven and p.pipeline > 2 else set()))
    stages = []
    for stage in kinds:
        dense, experts = parameter_counts(spec, cfg, stage)
        state = _state(cfg, dense, experts, world_size)
        terms, working, what = _stage_activations(spec, cfg, m, stage, impl)
        in_flight = min(p.pipeline - stage, micro)
        workspace = 0.0
        if impl == "local":
            # megatron's global "mpu" buffer stays at its largest request: the unfused attention's scores
            # (baddbmm output) or, under sequence parallelism, a linear's all-gathered input.
            # (The local MLA core, model.mla, does not use it.)
            scores = _scores(spec, m) * a if spec.attention != "mla" else 0
            workspace = max(scores, m.tokens * spec.hidden_size * a if sp > 1 else 0)
        name = "first" if stage == 0 else "last" if stage == p.pipeline - 1 else "middle"
        if p.pipeline == 1:
            name = "only"
        stages.append(StageMemory(
            stage=name, params=state.params, grads=state.grads, optimizer=state.optimizer, reference=state.reference,
            host_optimizer=state.host_optimizer,
            activations=in_flight * sum(terms.values()), working=working, micro_batches_in_flight=in_flight,
            activation_terms=terms, working_what=what, workspace=workspace,
        ))
    notes = []
    if spec.is_moe:
        notes.append(f"routed tokens per rank and MoE layer: {spec.moe_topk * m.etp * m.tokens / sp:,.0f} "
                     "(balanced routing; the busiest expert rank may receive more)")
    return MemoryEstimate(stages=stages, overhead=overhead, impl=impl, seq_len=s, micro_batches=micro, notes=notes)
