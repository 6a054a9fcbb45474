"""The trainer's typed configuration: one dataclass per YAML section, checked once before anything starts.

    cfg = load_config("examples/tiny_moe_cpu.yaml", ["parallel.tensor=2", "algo.name=grpo"])

Every field has a default and a docstring. ``validate(cfg, world_size)`` checks each rule that can be
checked without starting a process group (divisibility, compatible options) and raises ``ConfigError``
naming the field and the fix.

Long by design: the sections and their fields' docstrings are the reference of every YAML key, kept in one
place, and the loader (overrides, types, relative paths) is a small part of it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gspo_megatron.model.hub import is_repo_id
from gspo_megatron.algo.defaults import CORRECTION_HIGH, CORRECTION_LOW, GRPO_AGGREGATION, KL_ESTIMATOR, MAX_LOG_RATIO


class ConfigError(ValueError):
    """A config field is wrong; the message names it (``section.field``) and says how to fix it."""


@dataclass
class ModelConfig:
    hf_dir: str = ""
    """Hugging Face model directory (config.json, safetensors, tokenizer), or a Hub repo id (``Qwen/Qwen3-30B-A3B``:
    its snapshot in huggingface_hub's cache, downloaded first when online). Required unless ``tiny`` builds it."""
    tiny: dict = field(default_factory=dict)
    """If set and ``hf_dir`` does not exist yet: build a random model there of these sizes (vocab_size, hidden_size,
    num_layers, num_heads, num_kv_heads, head_dim, num_experts, top_k, moe_intermediate_size) and ``family``:
    qwen3_moe (the default), glm4_moe, deepseek_v3, gpt_oss, minimax_m2, qwen3_5_moe (its text model) or glm_moe_dsa
    (GLM-5: megatron-core 0.19.2; rewards/synthetic.py)."""
    warm_start_steps: int = 0
    """With ``tiny`` and ``data.task``: this many supervised steps of 32 task demonstrations before RL (the CPU
    example's brief warm start, so the random model has seen the answer format; the tool-use example's, so it has
    seen calculator calls)."""
    warm_start_lr: float = 3e-3
    """The warm start's AdamW learning rate."""
    megatron_checkpoint: str = ""
    """Start from this Megatron dist checkpoint's weights instead of hf_dir's (hf_dir still gives the tokenizer and the
    servers' start): a converted model (tools/convert_hf_to_megatron.py), or a training run's checkpoint.dir, its
    step_N dir or latest (weights only: optimizer and data position start afresh). Any layout: resharded on load."""
    dtype: str = "float32"
    """Parameter dtype: float32 or bfloat16 (bf16 needs a GPU to be fast)."""
    grouped_gemm: bool | None = None
    """MoE experts as one grouped GEMM per projection (megatron's TEGroupedMLP) instead of a Python loop over the
    local experts (SequentialMLP). null: on where TransformerEngine imports; true without TE is an error.
    Checkpoints load into either layout."""
    mla_down_proj_fusion: bool = False
    """Multi-latent attention with q LoRA (DeepSeek-V3, Kimi-K2): megatron's fused down projection, q_a_proj and
    kv_a_proj_with_mqa as one GEMM (``linear_qkv_down_proj``; under TransformerEngine the input norm is fused in
    too). Needs megatron-core 0.19 (0.16.1 lacks it: an error, as are models without q LoRA or MLA). Checkpoints
    load into either layout; conversion and weight sync name the same HF tensors."""
    update_expert_bias: bool = False
    """DeepSeek-V3 / GLM-4.5 sigmoid routers: let megatron move each router's expert bias (HF
    ``e_score_correction_bias``) towards balanced expert load after every step (aux-loss-free balancing). Off by
    default: the bias stays as loaded, so the rollout engine routes as the trainer does (``provider.freeze_expert_bias``);
    on or off, weight sync and conversion carry the bias the trainer routes with."""


@dataclass
class ParallelConfig:
    tensor: int = 1
    """Tensor-parallel size (attention heads, MLP and vocabulary are split over it)."""
    pipeline: int = 1
    """Pipeline-parallel size (layers are split over it, evenly unless first/last_stage_layers are set)."""
    first_stage_layers: int | None = None
    """Uneven pipeline stages: layers of the first stage (megatron's num_layers_in_first_pipeline_stage); the
    stages without a set count split the rest evenly. For layer counts no stage count divides (DeepSeek-V3 and
    Kimi-K2 have 61) or a lighter first stage (it also holds the embedding). None: an even split."""
    last_stage_layers: int | None = None
    """Uneven pipeline stages: layers of the last stage (it also holds the output layer and the loss)."""
    expert: int = 1
    """Expert-parallel size (MoE experts are spread over it)."""
    expert_tensor: int | None = None
    """Tensor-parallel size inside each expert (default: the same as ``tensor``)."""
    context: int = 1
    """Context-parallel size (needs TransformerEngine attention)."""
    sequence_parallel: bool = True
    """Shard activations along the sequence over the TP group (required by MoE when tensor > 1)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    micro_batch_size: int = 1
    """Sequences per micro batch."""
    pack_sequences: bool = False
    """Run each micro batch as one row of its sequences back to back, no padding (``parallel.packing``):
    TransformerEngine's THD attention on GPUs, a block-diagonal causal mask with megatron's local attention. Off by
    default (rows padded to the rollout's longest sequence). Not with parallel.context > 1 yet."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget per micro batch (needs pack_sequences): a minibatch's sequences on each data-parallel rank are
    balanced into the fewest micro batches of at most this many tokens (a longer sequence is its own micro batch),
    as many on every rank; replaces micro_batch_size. None (default): micro_batch_size sequences each."""


@dataclass
class RecomputeConfig:
    """Activation recompute (megatron's recompute_* fields); ``plan`` counts activations for exactly this."""

    granularity: str = "none"
    """none (megatron's default: keep every activation), selective (recompute ``modules`` in backward) or full
    (whole layers: ``method``, ``num_layers``). Not selective core_attn by default: TransformerEngine's flash
    attention keeps no score matrix, so recomputing it would cost time for nothing (megatron warns)."""
    modules: list = field(default_factory=lambda: ["core_attn"])
    """For selective: core_attn (attention scores and softmax), moe (whole MoE layers: the routed experts'
    activations, the largest part at long sequences), mlp (dense MLPs), layernorm (needs TransformerEngine)."""
    method: str = "uniform"
    """For full: uniform (keep the input of every chunk of ``num_layers`` layers, recompute each chunk in
    backward) or block (recompute the first ``num_layers`` layers of each pipeline stage, keep the others whole)."""
    num_layers: int = 1
    """For full: layers per recomputed chunk (uniform) or recomputed layers per pipeline stage (block)."""


@dataclass
class PerformanceConfig:
    """Megatron-Core's speed settings (``train.startup.performance`` turns them into TransformerConfig and DDP fields).

    None where a field allows it means: on where this machine has what it needs (TransformerEngine, CUDA, apex's
    extension), off elsewhere; true where it is missing is an error naming the field. None of them changes what
    a step computes beyond floating-point rounding (tests/train/startup/test_performance.py)."""

    moe_token_dispatcher: str = "alltoall"
    """How tokens reach their experts' ranks: alltoall (all-to-all over EP; megatron's choice for EP > 1),
    allgather (every rank gathers every token: simple, for small EP) or flex (DeepEP / HybridEP kernels that
    fuse the permutation and the communication; needs CUDA, the deep_ep package and tensor*expert > 1)."""
    moe_flex_backend: str = "deepep"
    """For moe_token_dispatcher=flex: deepep or hybridep (both from the deep_ep package)."""
    moe_router_dtype: str = "fp32"
    """Router logits, softmax/top-k and the weighting of expert outputs in fp32 (or fp64, or none: the model's
    dtype). fp32 so routing in bf16 training does not flip on bf16 rounding of the probabilities (SGLang takes
    its top-k over fp32 softmax of its bf16 gate logits)."""
    moe_permute_fusion: bool | None = None
    """Token (un)permutation around the experts in TransformerEngine's fused kernels (TE >= 2.1)."""
    apply_rope_fusion: bool | None = None
    """RoPE on queries and keys in TransformerEngine's fused kernel."""
    gradient_accumulation_fusion: bool | None = None
    """Weight-gradient GEMMs accumulate straight into the fp32 gradient buffer (megatron's main_grad): needs CUDA
    and apex's fused_weight_gradient_mlp_cuda extension (NGC PyTorch containers have it; PyPI has no apex)."""
    bias_activation_fusion: bool | None = None
    """SwiGLU as one torch.compile'd kernel (megatron's bias_swiglu). None: on under CUDA."""
    bias_dropout_fusion: bool | None = None
    """The residual add (bias, dropout: none here) as one torch.compile'd kernel. None: on under CUDA."""
    overlap_grad_reduce: bool = False
    """DDP: reduce (or reduce-scatter) each gradient bucket as soon as backward fills it, overlapping the rest of
    backward, instead of all at once after it."""
    overlap_param_gather: bool = False
    """DDP with parallel.distributed_optimizer: all-gather each bucket's updated parameters in the next forward,
    just before its layers need them, instead of right after the optimizer step (weight sync and checkpoints
    gather the rest first)."""


@dataclass
class RolloutConfig:
    engine: str = "sglang"
    """sglang (servers launched by us on loopback or ``urls``) or local (in-process sampling)."""
    urls: list = field(default_factory=list)
    """Attach to these SGLang servers (or one sglang-router) instead of launching one."""
    group_size: int = 8
    """G: responses sampled per prompt."""
    prompts_per_step: int = 8
    """Prompts per RL step; the rollout batch is prompts_per_step * group_size sequences."""
    max_new_tokens: int = 64
    """The longest response, in tokens (a longer one stops there, truncated: ``on_truncated`` says what then)."""
    max_prompt_tokens: int = 512
    """Prompts longer than this are an error (they also size the memory estimate of ``plan``)."""
    temperature: float = 1.0
    """Sampling temperature (1: the policy's own distribution, which GSPO's ratios assume)."""
    top_p: float = 1.0
    """Nucleus sampling (1: off). Below 1 the samples no longer follow the policy the ratios are taken against."""
    top_k: int = -1
    """Sample from the k likeliest tokens only (-1: off); the same caveat as top_p."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response besides the tokenizer's end token (SGLang's ``stop_token_ids``): the response
    keeps the stop token and is not truncated."""
    filter_zero_variance_groups: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (zero advantage: no GSPO signal) and sample
    more prompts until prompts_per_step groups remain, for at most max_sampling_rounds rounds; a batch still short
    then is filled with dropped groups (logged as sampling/uniform_groups_kept)."""
    max_sampling_rounds: int = 3
    """With filter_zero_variance_groups: generation rounds per step at most (the first included)."""
    reuse_rollout_logprobs: bool = False
    """Use SGLang's log-probs as pi_old instead of recomputing them in the trainer (the GSPO paper allows it)."""
    mode: str = "sync"
    """sync (sample each batch when its step starts), one_step_off (sample batch k+1 while the trainer updates on
    batch k; the weight sync waits for it: every sample one version old) or async (up to max_staleness batches
    sampled ahead; weight syncs pause the servers' requests in flight and continue them on the new weights).
    Samples from older weights than the trainer's take the engine's log-probs as pi_old (or, with
    algo.decoupled_clip, clip around the trainer's and are weighted by the engine's)."""
    colocate: bool = False
    """Colocated rollouts (``rollout/colocate.py``, ``train/sampling/colocate.py``): the launched SGLang servers share the
    trainer's GPUs. After each rollout they release their weights and KV cache to training; after the update they
    resume them and take the new weights through update_weights_from_tensor (tensor handles, no process group:
    ``rollout.weight_sync`` does not apply). Needs rollout.mode=sync; size the servers' share with
    rollout.server_args.mem_fraction_static (``plan`` prints both sides' peaks)."""
    colocate_offload: str = "none"
    """With colocate: what the trainer hands over too between its updates (``train/sampling/colocate.py``). none:
    it keeps everything on its GPUs. optimizer: after each update, before the servers resume, the optimizer's state
    (Adam's moments, and the fp32 master weights of bf16 training) goes to pinned host memory and the gradient
    buffers are freed (zeroed before every update anyway); both come back after the next rollout's release, before
    the update. Costs a copy each way per step; ``plan`` counts it out of the rollout and sync phases."""
    max_staleness: int = 1
    """With mode=async: batches sampled ahead, so a sample is at most this many weight versions older than the
    weights it is trained on (one_step_off is 1 without pausing)."""
    partial_chunk_tokens: int | None = None
    """Partial rollouts (``train/sampling/partial_rollouts.py``; the issue's max_tokens_per_step, slime's / Kimi k1.5's
    partial rollout): generation runs in chunks of at most this many new tokens per sample, with up to
    partial_groups_in_flight groups in flight; the step ends as soon as prompts_per_step groups are complete (all
    G samples finished), and the samples still running are cut there and continued next step, from their token
    ids, under the new weights (at most max_new_tokens in all). None (default): responses generated whole."""
    partial_groups_in_flight: int | None = None
    """With partial_chunk_tokens: groups generating at once at most (slime's over-sampling), so that when
    prompts_per_step of them are complete others are still running and are carried. None: 2 x prompts_per_step."""
    partial_mask: str = "none"
    """With partial_chunk_tokens: none (every token of a sample spanning weight versions trains, pi_old the
    engine's per-token log-probs of the version that sampled it) or old_tokens (tokens sampled by weights older
    than the trainer's carry no loss: only the current version's chunk trains)."""
    weight_sync: str = "distributed"
    """distributed (broadcast to the servers) or disk (save HF safetensors, server reloads)."""
    weight_sync_address: str | None = None
    """Rank 0's address as the servers see it, for the distributed sync; None: 127.0.0.1 for local servers, else
    this host's fully qualified name. Set it for servers on other nodes when that name does not resolve. (Each
    pipeline stage sends from its first rank; stages on other nodes are reached at their own names.)"""
    fp8: bool = False
    """FP8 rollouts (``model/fp8.py``, ``rollout/weight_sync.py``): the trainer stays in its dtype; every weight sync
    (distributed, disk, colocated tensor) sends the decoder layers' linear weights block-FP8 (float8_e4m3fn, one fp32
    ``weight_scale_inv`` per 128 x 128 block, quantized bucket by bucket as they stream), and servers we launch start
    from an FP8 copy of the model (``quantization_config`` in its config.json, so SGLang builds FP8 layers; attached
    servers must serve such a copy: ``tools/convert_megatron_to_hf.py --fp8``). Embeddings, lm_head, norms and
    routers stay in the trainer's dtype. Each part of a merged projection (q, k, v; gate, up) must be whole 128-row
    blocks per server TP rank, as SGLang requires (checked at start-up). Serving runs SGLang's FP8 GEMMs on GPUs; on
    CPU servers a torch stand-in of them (patches/sglang_cpu: the same numbers, no speed-up; docs/weight-sync.md)."""
    fp8_keep_layers: int = 0
    """With fp8: the first and last N decoder layers stay in high precision (NeMo-RL's option; 0: all quantized)."""
    server_args: dict = field(default_factory=dict)
    """Extra sglang.launch_server arguments for servers we launch."""
    timeout_s: float = 300.0
    """A rollout request that takes longer per KV cache of tokens in flight on its server counts as a hung server
    (restarted if launched, waited for if attached). Requests are sized and admitted to fit each server's KV cache
    (its max_total_num_tokens, counting every sample at its prompt plus max_new_tokens), so that is one cache's
    worth of decoding, unless one prompt's samples alone exceed the cache."""
    max_server_restarts: int = 3
    """A launched server that dies or hangs is restarted at the current weights and its requests resent, at most this
    many times per restart_window_s (then TooManyRestarts naming it); 0: the failure stops the run."""
    restart_window_s: float = 3600.0
    """The window max_server_restarts counts restarts of one server in (seconds)."""
    attached_wait_s: float = 120.0
    """An attached server (urls) that refuses connections or hangs is waited for this long, then named in an error."""
    on_truncated: str = "keep"
    """A response cut at max_new_tokens (finish_reason length; counted as ``responses_truncated``): keep (trained
    with its reward) or mask (out of the loss and of its group's mean and std, like a failed reward: DAPO's
    overlong filtering)."""
    env: str = ""
    """Multi-turn rollouts (``rewards.multiturn``): an environment class, ``module:Class`` or a built-in
    (calculator, python), with reset(prompt) and step(text, token_ids) -> Step(observation, reward, done). The
    trajectory's reward is the sum of its turn rewards (``data.reward`` is not used). Empty: single-turn responses."""
    env_args: dict = field(default_factory=dict)
    """Keyword arguments of the environment class (one instance per trajectory); a built-in's are checked at start
    (python: cpu_seconds, memory_mb, output_bytes, wall_seconds)."""
    max_turns: int = 4
    """With env: model turns per trajectory (each at most max_new_tokens)."""
    max_trajectory_tokens: int = 256
    """With env: response tokens per trajectory, model turns and observations together (the prompt excluded)."""
    env_concurrency: int = 32
    """With env: trajectories in flight at once (one thread each; the local engine runs them one at a time)."""


@dataclass
class AlgoSection:
    name: str = "gspo"
    """gspo, gspo_token, grpo (token-level PPO clip)."""
    eps_low: float | None = None
    """Lower clip; default 3e-4 for GSPO, 0.2 for GRPO (the paper's values)."""
    eps_high: float | None = None
    """Upper clip; default 4e-4 for GSPO, 0.27 for GRPO (both bounds: ``algo.defaults.CLIP_RANGES``)."""
    max_log_ratio: float = MAX_LOG_RATIO
    """The log importance ratio is clamped to +-this before exp, so a ratio stays finite (algo/surrogate.py)."""
    grpo_aggregation: str = GRPO_AGGREGATION
    """GRPO's normalisation: token-mean (every token weighs the same) or seq-mean-token-mean (every sequence)."""
    token_advantages: str = "sequence"
    """Where per-token advantages come from (gspo_token, grpo): sequence (A_i on every token; GSPO-token then equals
    GSPO) or segments (``data.segment_reward``'s per-segment rewards, group-normalised, summed over the segments at
    and after each token: DeepSeekMath's process supervision) or turns (the same with ``rollout.env``'s per-turn
    rewards as the segments, each ending at its turn's last model token, discounted by ``gamma``)."""
    gamma: float = 1.0
    """With token_advantages=turns: the discount of later turns' rewards in a token's advantage (1: undiscounted)."""
    routing_replay: str | None = None
    """MoE routing replay: false, old or rollout. old: GRPO + Routing Replay, the old-policy pass records its experts
    (``old_routing``) and the update replays them. rollout (R3): the SGLang engine returns the experts it routed
    every token to (prompt and response: ``rollout_routing``) and the old-policy pass and the update both replay them.
    false: the routers choose freely. true is accepted as old (the value before rollout existed)."""
    kl_coef: float = 0.0
    """KL penalty against a frozen reference (the starting weights); GSPO uses none. > 0 adds a reference pass."""
    kl_estimator: str = KL_ESTIMATOR
    """With kl_coef > 0: the KL estimator, k1, k2 or k3 (Schulman's; k3 is non-negative and unbiased)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus entropy_coef x the policy's mean entropy per response token (normalised like
    the loss). Keeps small policies exploring; 0 (the paper's setting) skips the entropy computation."""
    normalize_advantage_std: bool = True
    """Advantages are (r - group mean) / group std; false: r - group mean (Dr. GRPO)."""
    fused_loss: bool = True
    """The update pass computes the loss inside the output layer's vocab-parallel op, chunk by chunk (three logits
    matmuls, ops.sequence_loss); false: the log-prob op, then the loss (four: its backward recomputes the logits)."""
    minibatches: int = 4
    """Optimizer steps per rollout batch (the paper uses 4)."""
    decoupled_clip: bool = False
    """Samples from older weights than the trainer's (rollout.mode one_step_off / async, partial rollouts) clip
    around the trainer's weights at the update's start (the old-policy pass: the proximal policy) instead of the
    engine's, and the correction section weights them by pi_prox / pi_behaviour (AReaL's decoupled PPO,
    ``algo/correction.py``); with correction.level unset it is geometric (token for GRPO), truncated at
    correction.high. false: such a sample's pi_old is the engine's, and after the first optimizer step GSPO's narrow
    range clips most of them."""

    def __post_init__(self):
        # One value: None or the replayed routing's name. YAML true / false (read as the strings "True" / "False"),
        # the values before rollout existed, are old / None.
        if isinstance(self.routing_replay, (bool, str)):
            value = str(self.routing_replay).lower()
            self.routing_replay = {"true": "old", "yes": "old", "false": None, "no": None}.get(value, value)

    @property
    def replays_old_routing(self) -> bool:
        """GRPO + Routing Replay: the old-policy pass records the experts the update replays."""
        return self.routing_replay == "old"

    @property
    def replays_rollout_routing(self) -> bool:
        """Rollout routing replay (R3): both passes replay the experts the engine routed to."""
        return self.routing_replay == "rollout"


@dataclass
class CorrectionSection:
    """The behaviour weight w_t = pi_old(y_t) / pi_engine(y_t) between the trainer's old policy and the engine's
    log-probs (training-inference mismatch; stale samples with algo.decoupled_clip), in the loss
    (``algo/correction.py``, docs/mismatch.md). With rollout.reuse_rollout_logprobs the current policy (detached)
    stands in for pi_old: verl's bypass mode. Off by default."""

    level: str | None = None
    """token (w_t), sequence (prod_t w_t) or geometric (exp(mean_t log w_t)); null: no weight."""
    mode: str = "truncate"
    """truncate (min(w, high): TIS) or mask (w = 0 outside [low, high]: IcePop; the token stays in the denominator)."""
    low: float = CORRECTION_LOW
    """With mode=mask: the lowest weight kept."""
    high: float = CORRECTION_HIGH
    """The truncation (mode=truncate) or the highest weight kept (mode=mask)."""
    rejection: str | None = None
    """Drop whole sequences (out of the loss and its denominator) by a statistic of their tokens: max (of |log w_t|,
    or of k3), mean or sum (of log w_t, or of k3 = w_t - 1 - log w_t); null: no rejection by a statistic."""
    rejection_estimator: str = "k1"
    """The rejection statistic's per-token term: k1 (log w_t) or k3 (w_t - 1 - log w_t >= 0)."""
    rejection_low: float | None = None
    """Reject a sequence whose statistic is below this (e.g. log 0.999 for verl's geometric 0.999_1.001)."""
    rejection_high: float | None = None
    """Reject a sequence whose statistic is above this (e.g. log 1.001; 0.01 for verl's K3-RS)."""
    veto: float | None = None
    """Reject a sequence holding a token with w_t below this (slime's 1e-4); null: no veto."""

    @property
    def enabled(self) -> bool:
        return self.level is not None or self.rejection is not None or self.veto is not None


@dataclass
class OptimizerSection:
    lr: float = 1e-6
    """Peak learning rate (Adam)."""
    min_lr: float = 0.0
    """The learning rate that linear or cosine decay ends at."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr."""
    lr_decay: str = "constant"
    """constant, linear or cosine (over train.steps)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's epsilon."""
    clip_grad: float = 1.0
    """Gradients are clipped to this global norm (over every rank's shard); 0: no clipping."""
    offload_fraction: float = 0.0
    """Share of the optimizer's state (fp32 master weights, Adam's moments) kept in pinned host memory and stepped
    by the CPU (megatron's HybridDeviceOptimizer: OptimizerConfig.optimizer_cpu_offload, optimizer_offload_fraction,
    with its precision-aware optimizer and overlapped copies, as slime and verl run it). 0: off; 1: all of it. Per
    offloaded parameter the host holds 16 B (master, moments and an fp32 copy of the gradient), the GPU saves 12 B
    (bf16) or 8 B (fp32). Needs parallel.distributed_optimizer=true and CUDA (the copies run on CUDA streams);
    a fraction below 1 needs model.dtype=bfloat16. ``plan`` counts both sides (--host-memory-gib)."""
    grad_reduce_in_fp32: bool = True
    """DDP's gradient buffer (megatron's main_grad) in fp32: micro batches accumulate and data-parallel ranks reduce
    in fp32. false (model.dtype=bfloat16 only): in bf16, 2 B per parameter instead of 4, at the cost of bf16
    rounding in the accumulation and the reduction (Megatron-LM's default without
    --accumulate-allreduce-grads-in-fp32)."""


@dataclass
class DataConfig:
    prompts: str = ""
    """JSONL of {"prompt": str, "answer": ...} or {"messages": [...], "answer": ...}; or parquet (*.parquet, verl's
    layout: prompt as chat messages, reward_model.ground_truth), or a Hugging Face datasets dir (save_to_disk)."""
    prompt_key: str = ""
    """The records' prompt field (text, chat messages or token ids; dotted for nested). "": prompt_ids, messages or
    prompt."""
    label_key: str = ""
    """The field passed to the reward as its label, as it is (dotted for nested). "": answer, label, tests or
    reward_model.ground_truth; "*": the whole record (its metadata, e.g. verl's extra_info, included)."""
    tools_key: str = "tools"
    """A chat prompt's tool schemas (a list of objects, or that list as a JSON string), given to the chat template as
    its ``tools`` (Qwen3's and OpenAI's function calling); "": none."""
    system_prompt: str = ""
    """A system message put before every chat prompt (and a plain-text prompt then goes through the chat template)."""
    apply_chat_template: bool = False
    """Put plain-text prompts through the tokenizer's chat template as one user message (chat messages always are)."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Passed to the chat template, e.g. {enable_thinking: false} for Qwen3."""
    task: str = ""
    """A synthetic task shipped in the repo instead of a file (gspo_megatron.rewards.synthetic: reverse, copy, add,
    count, mul; copy_long: 64-72-letter words, for responses of that length)."""
    eval_prompts: str = ""
    """Held-out prompts for train.eval_every (the formats of ``prompts``); with ``task``: 64 of the task's problems
    from another seed."""
    skip_malformed: bool = False
    """Skip (and count) malformed JSONL lines instead of stopping at the first with its line number."""
    long_prompts: str = "error"
    """A prompt longer than rollout.max_prompt_tokens: error (stop, naming its file and line) or drop (skip it and
    count it; the count is printed at start). A built-in task's prompts must always fit."""
    reward: str = "math"
    """math, exact_match, synthetic (the built-in tasks' partial-credit score), code_tests (the fraction of the
    prompt's tests, its "tests" field, that the response's program passes in a sandbox: rewards/code_tests.py), or
    module:function."""
    sandbox: str = "confined"
    """How code_tests and rollout.env=python run the model's programs (rewards/sandbox.py): confined (new user,
    mount, PID and network namespaces: it sees only the interpreter, read-only, and its scratch directory, cannot
    touch this user's files or processes, and its processes die with it; a host that refuses unprivileged user
    namespaces stops the run at start, saying so) or unconfined (accepts the risk there: only time, CPU, memory and
    output limits, as this user, who can read and delete what this user can)."""
    reward_workers: int = 2
    """Reward calls run in this many worker processes (rank 0's), each call limited to ``reward_timeout_s``: a reward
    that hangs or crashes its worker has its sample masked (out of the loss and its group's statistics) and counted
    (``reward_timeouts``, ``reward_crashes``), whatever ``on_reward_error`` says; the step goes on. 0: call the
    reward in the trainer's process, with no time limit."""
    reward_timeout_s: float = 60.0
    """Time limit of one reward call (with code_tests: more than all of a response's sandbox runs, 10 s each)."""
    on_reward_error: str = "raise"
    """raise: a reward that raises or is not finite stops the step naming the sample; mask: drop the sample (it also
    leaves its group's mean and std). Either way a step whose rewards all failed stops the run with the reward's
    error, as does a share of failures above ``max_masked_reward_share``."""
    max_masked_reward_share: float = 0.5
    """The run stops with the reward's error when more than this share of the rewards of the last
    ``masked_reward_window`` steps were masked (failed, timed out or crashed): a broken reward does not train to the
    end learning nothing. 1: only a step with every reward masked stops it."""
    masked_reward_window: int = 10
    """Steps over which ``max_masked_reward_share`` is measured (checked once that many steps ran)."""
    segment_reward: str = ""
    """Per-segment rewards for algo.token_advantages=segments: synthetic (the built-in tasks' credit per character)
    or module:function, fn(prompt, response_tokens: list[str], label) -> [(end, reward), ...] with ``end`` the
    number of response tokens up to and including the segment's last one, rising."""
    seed: int = 1234
    """The order the prompts are drawn in, and a built-in task's problems."""


@dataclass
class TrainSection:
    steps: int = 100
    """RL steps (each: one rollout batch, ``algo.minibatches`` optimizer steps, one weight sync)."""
    eval_every: int = 0
    """Every N steps, the mean reward of one sampled response per ``data.eval_prompts`` prompt; 0: never."""
    seed: int = 1234
    """A tiny model's random weights, Megatron's RNG, and the servers' sampling seed."""
    max_consecutive_nonfinite: int = 3
    """A step whose loss or gradient is NaN/inf on any rank skips that update on every rank (``skipped_updates``) and
    saves its batch to ``<logging.dir>/nonfinite/``; this many such steps in a row stop the run with NonFiniteError
    before that step's checkpoint. 0: never stop."""
    cpu_threads: int | None = None
    """torch's intra-op threads in each trainer process (None: torch's default, every core). On a CPU shared with
    the rollout server (``rollout.server_args.cpu_threads``), threads beyond the cores left to the trainer wait
    on busy cores and slow every op; GPU runs need none."""


@dataclass
class CheckpointConfig:
    dir: str = ""
    """Where step_N checkpoints and ``latest`` are written ("": no checkpoints); --resume continues from it."""
    every: int = 0
    """Save every N steps (0: only at the end, at a stop signal, and by ``every_minutes``)."""
    every_minutes: float = 60.0
    """Save also when this many minutes have passed since the last save (or the start), by rank 0's clock: what a
    crash loses stays bounded whatever ``every`` is (0: off)."""
    keep: int = 2
    """How many of the newest step dirs stay; older ones are removed once a newer one is complete (0: all)."""
    async_save: bool = False
    """Write checkpoints in the background (megatron's asynchronous torch_dist save): training continues once
    the tensors are copied to host memory; ``latest`` names the checkpoint when every rank has written it."""


@dataclass
class LoggingConfig:
    dir: str = "runs/default"
    """Where metrics.jsonl, metrics.png and TensorBoard events are written."""
    tensorboard: bool = True
    """Write TensorBoard events when tensorboard is installed."""
    wandb_project: str = ""
    """Log to Weights & Biases when set (and wandb is installed)."""
    plot_every: int = 5
    """Redraw metrics.png every N steps and at the last step; 0: no plot."""
    expert_volatility: bool = True
    """MoE with algo.minibatches >= 2 and the old-policy pass: log the fraction of (token, layer) routing decisions
    whose top-k experts one optimizer step changed (the old pass's experts vs the second minibatch's forward, no
    extra forward; the old pass keeps the record, int16, until that forward)."""


@dataclass
class DistributedConfig:
    timeout_s: float = 1800.0
    """Time limit of every training collective (the world and megatron's groups; NCCL on GPUs, whose watchdog
    aborts the job past it). It must cover the longest wait inside one: a rank that has written its checkpoint
    shard waits for the slowest writer, and during weight sync the ranks wait in the export's gathers while rank 0
    sends one bucket (bounded by the weight sync's own 600 s per call, which must be shorter)."""
    control_timeout_s: float = 7200.0
    """Time limit of the waits for rank 0's solo work (``parallel.control``, a gloo group no watchdog watches):
    a whole rollout or eval, the servers' start, weight-sync set-up. It must exceed the rollout's own limit
    (``rollout.server_args.rollout_timeout_s``, 3600 s by default), so a stuck rollout fails on rank 0 with
    an error naming the server instead of timing out elsewhere."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoSection = field(default_factory=AlgoSection)
    correction: CorrectionSection = field(default_factory=CorrectionSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


# ---- loading ---------------------------------------------------------------------------------------


# What the config decides about the loop's passes (read by the policy's construction and by the update).


def runs_old_pass(cfg: Config) -> bool:
    """The trainer recomputes pi_old unless rollout.reuse_rollout_logprobs takes the engine's; Routing Replay needs
    the pass anyway (it records the experts to replay); rollout routing replay does not (the engine's experts
    come with the rollout)."""
    return not cfg.rollout.reuse_rollout_logprobs or cfg.algo.replays_old_routing


def correction(cfg: Config):
    """The loss's ``algo.Correction``: the correction section's, or with algo.decoupled_clip and no level set,
    the decoupled objective's weight (geometric, per token for GRPO whose ratio is; truncated at correction.high).
    A bad value raises ValueError naming its field."""
    from gspo_megatron.algo.correction import Correction

    values = dataclasses.asdict(cfg.correction)
    if cfg.algo.decoupled_clip and values["level"] is None:
        values.update(level="token" if cfg.algo.name == "grpo" else "geometric", mode="truncate")
    return Correction(**values)


def measures_volatility(cfg: Config, spec) -> bool:
    """Expert volatility needs routed experts, a second minibatch (a forward after one step), the old pass's
    record, and free routing in the update (Routing Replay pins it)."""
    return (cfg.logging.expert_volatility and spec.is_moe and cfg.algo.minibatches >= 2
            and runs_old_pass(cfg) and not cfg.algo.routing_replay)


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """YAML value -> the field's type, with an error naming the field."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Union or (origin is not None and type(None) in args):
        if value is None and type(None) in args:
            return None
        choices = [a for a in args if a is not type(None)]
        for choice in choices[:-1]:  # bool | str: true/false as a bool, anything else as a string
            try:
                return _coerce(value, choice, where)
            except ConfigError:
                pass
        annotation = choices[-1]
        origin = typing.get_origin(annotation)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if annotation in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            number = annotation(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}") from None
        if annotation is int and isinstance(value, float) and number != value:
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return number
    if annotation is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    if annotation is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return value
    if annotation is list or origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = typing.get_args(annotation)
        return [_coerce(v, item[0], f"{where}[{i}]") for i, v in enumerate(value)] if item else value
    return value


def unknown_names(unknown, known, title: str) -> str:
    """'title ['optimiser'] (did you mean 'optimizer'?); known: [...]' for misspelt names."""
    guesses = {name: difflib.get_close_matches(str(name), list(known), n=1, cutoff=0.6) for name in unknown}
    hints = [(name, match[0]) for name, match in guesses.items() if match]
    if len(unknown) == 1 and hints:
        hint = f" (did you mean {hints[0][1]!r}?)"
    else:
        hint = f" (did you mean {', '.join(f'{m!r} for {n!r}' for n, m in hints)}?)" if hints else ""
    return f"{title} {sorted(unknown)}{hint}; known: {sorted(known)}"


def _takes_none(annotation) -> bool:
    return type(None) in typing.get_args(annotation)


def _build(cls, values: dict, where: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping of fields, got {values!r}")
    types = _field_types(cls)
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ConfigError(unknown_names(unknown, types, f"{where}: unknown field(s)" if where else "unknown section(s)"))
    kwargs = {}
    for name, annotation in types.items():
        # null (`data.eval_prompts=null`, or `eval_prompts:` left empty in a YAML) unsets a field: its default
        if name not in values or (values[name] is None and not _takes_none(annotation)):
            continue
        key = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(annotation):
            kwargs[name] = _build(annotation, values[name] or {}, key)
        else:
            kwargs[name] = _coerce(values[name], annotation, key)
    return cls(**kwargs)


def _apply_override(tree: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.field=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part} is not a section")
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


# Fields naming files or directories. A relative path in a YAML file is relative to that file's folder (so a config
# means the same from any working directory); on the command line (overrides), to the working directory.
PATH_FIELDS = (("model", "hf_dir"), ("model", "megatron_checkpoint"), ("data", "prompts"), ("data", "eval_prompts"),
               ("checkpoint", "dir"), ("logging", "dir"))


def _read_yaml(file: Path) -> dict:
    try:
        tree = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(file)
        problem = "; ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{file}: the top level must be a mapping of sections")
    return tree


def _relative_to(tree: dict, folder: Path) -> None:
    model = tree.get("model") if isinstance(tree.get("model"), dict) else {}
    for section, name in PATH_FIELDS:
        node = tree.get(section)
        value = node.get(name) if isinstance(node, dict) else None
        if isinstance(value, str) and value and not os.path.isabs(os.path.expanduser(value)):
            path = os.path.normpath(os.path.join(folder, value))
            # model.hf_dir: Qwen/Qwen3-30B-A3B, with nothing of that name beside the YAML, is a Hugging Face repo id
            if (section, name) == ("model", "hf_dir") and not model.get("tiny") and is_repo_id(value) \
                    and not os.path.exists(path):
                continue
            node[name] = path


# Fields naming user code as module:attribute (or path/to/file.py:attribute). In a YAML file, a module that Python
# cannot import but that lies beside the file (my_rewards.py) becomes that file's path, as paths do.
CODE_FIELDS = (("data", "reward"), ("data", "segment_reward"), ("rollout", "env"))


def _code_beside(tree: dict, folder: Path) -> None:
    import importlib.util

    from gspo_megatron.rewards.user_code import module_file

    for section, name in CODE_FIELDS:
        node = tree.get(section)
        value = node.get(name) if isinstance(node, dict) else None
        if not isinstance(value, str) or ":" not in value:
            continue
        module, _, attr = value.rpartition(":")
        if module.endswith(".py") and not os.path.isabs(os.path.expanduser(module)):
            node[name] = f"{os.path.normpath(os.path.join(folder, module))}:{attr}"
        elif module.isidentifier() and importlib.util.find_spec(module) is None:
            found = module_file(module, folder)
            if found is not None:
                node[name] = f"{found}:{attr}"


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """YAML file (or None for defaults) + dotted ``section.field=value`` overrides -> a typed Config.

    Relative paths in the YAML file (``PATH_FIELDS``) are relative to its folder, and so are the modules of its
    ``CODE_FIELDS`` that Python cannot import otherwise; in overrides, to the working directory."""
    tree: dict = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config file {path} does not exist")
        tree = _read_yaml(file)
        _relative_to(tree, file.parent)
        _code_beside(tree, file.parent)
    for override in overrides:
        _apply_override(tree, override)
    return _build(Config, tree, "")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
