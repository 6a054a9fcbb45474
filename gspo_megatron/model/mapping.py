"""The Hugging Face <-> Megatron tensor mapping, one declarative table per architecture.

Each ``Rule`` says which Megatron parameter is made of which HF tensors, how the HF tensors are joined into
it (``join``), and how the joined tensor is split over tensor-parallel ranks (``split``):

    join  "copy"  one HF tensor is the Megatron tensor
          "qkv"   q, k, v projections fused per query group: for each KV group g,
                  [q rows of g's heads (heads/groups * head_dim), k rows of g (head_dim), v rows of g (head_dim)]
          "glu"   gate and up projections concatenated: [gate; up] (Megatron's fc1 for a gated MLP)
          "cat"   the parts' rows stacked in order, of any sizes: [q_a_proj; kv_a_proj_with_mqa] (MLA's fused down
                  projection); under "column" each part is split first, so a rank holds [q_r; kv_r]
          "per_head"  each part holds, per key head, its ``Part.per_head`` sections (Qwen3-Next's in_proj_qkvz:
                  [q_h; k_h; v_h; z_h], in_proj_ba: [b_h; a_h]); the Megatron tensor holds each section for all of
                  the rank's key heads in turn: [q; k; v; z; b; a] (the GatedDeltaNet's in_proj)
    split "none"    replicated on every TP rank (norms, router)
          "column"  dim 0 over TP (ColumnParallelLinear); every HF part is split, then the parts are joined,
                    so a rank holds [q_r|k_r|v_r per local group] or [gate_r; up_r], as megatron-core does
          "row"     dim 1 over TP (RowParallelLinear)
          "vocab"   dim 0 over TP after padding the vocabulary rows to ``padded_vocab_size`` with zeros
          "down"    MLA's q / kv down projections: "column" where megatron's layer is column-parallel (the local
                    spec: it gathers the output), "none" where it is TE's duplicated ``TELinear``; the bridge reads
                    which from the parameter's ``tensor_model_parallel`` attribute

Scopes say where a rule applies: once per model (``model``, on the first or last pipeline stage), per
decoder layer (``layer``), per layer with a dense MLP (``dense``) or routed experts (``moe``), or per expert
(``expert``; split over the expert-tensor-parallel group, experts spread over expert-parallel ranks).
Names carry ``{layer}`` and ``{expert}``: global indices in HF names, this rank's local indices in Megatron
names (the bridge translates). ``te_name`` is the parameter's name under TransformerEngine's layer spec, where
the norm before a linear is fused into it. ``grouped`` is an expert weight's name when the layer's experts are
megatron's ``TEGroupedMLP`` (``moe_grouped_gemm`` with TE): one TE ``GroupedLinear`` per projection holding local
expert i's [out, in] weight as ``weight{i}`` (TE's ``grouped_linear.py`` registers them so), where a
``SequentialMLP`` holds ``local_experts.{i}.linear_fc1.weight``. The shapes and the TP split are the same in both
layouts (megatron builds each GEMM of the grouped linear with the expert-TP partition of one expert's linear), and
megatron's dist-checkpoint keys for experts are the same too (``TEGroupedMLP.sharded_state_dict``), so only the
in-memory names differ. ``dims`` give each HF tensor's shape in ``ModelSpec.dims()`` terms,
so a checkpoint is checked (missing / unexpected / mis-shaped tensors) before any model is built.

Conversion, SGLang weight sync and the local engine all use these tables through ``bridge.Bridge``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from .errors import UnsupportedModel
from .hf_config import ModelSpec

COPY, QKV, GLU, CAT, GATED_QKV, PER_HEAD = "copy", "qkv", "glu", "cat", "gated_qkv", "per_head"
NONE, COLUMN, ROW, VOCAB, DOWN = "none", "column", "row", "vocab", "down"
MODEL, LAYER, DENSE, MOE, EXPERT = "model", "layer", "dense", "moe", "expert"
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"  # the gated-DeltaNet hybrids' two layer kinds
FIRST, LAST = "first", "last"


@dataclass(frozen=True)
class Part:
    """One HF tensor, or one section of its rows: its name pattern and its (section's) shape as ModelSpec dims.

    ``sections``: the HF tensor's rows are these dims' sizes stacked, and this part is section ``section`` of them
    (the gated DeltaNet's in_proj_qkv and conv1d hold [q; k; v]: each is split over TP on its own, as megatron's
    in_proj holds [q_r; k_r; v_r; ...] on rank r). Parts of one tensor come in order; the export stacks them again."""

    name: str
    dims: tuple[str, ...]
    sections: tuple[str, ...] = ()
    section: int = 0
    per_head: tuple[str, ...] = ()  # the "per_head" join: the dims of the sections each key head's rows hold

    def full_rows(self, dims: dict[str, int]) -> int:
        return sum(dims[d] for d in self.sections) if self.sections else dims[self.dims[0]]

    def row_offset(self, dims: dict[str, int]) -> int:
        return sum(dims[d] for d in self.sections[: self.section])


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[Part, ...]
    join: str = COPY
    split: str = NONE
    scope: str = LAYER
    stage: str | None = None  # model scope: the pipeline stage holding it
    te_name: str | None = None
    grouped: str | None = None  # expert rules: the name under TEGroupedMLP
    # only for some models: "tied" / "untied" embeddings, "qkv_bias" / "qk_norm" where the config turns them on;
    # MLA's "q_lora" / "no_q_lora", and its down projections: "q_down_proj" + "kv_down_proj" (separate) or
    # "qkv_down_proj" (megatron's mla_down_proj_fusion)
    when: str | None = None
    # The last pipeline stage's copy of a tied embedding: filled on load where the model has it, never exported
    # (the first stage exports the embedding once).
    tied_copy: bool = False


def P(name: str, *dims: str) -> Part:
    return Part(name, dims)


def sections(name: str, rows: tuple[str, ...], *rest: str) -> tuple[Part, ...]:
    """The row sections of one HF tensor as parts (``Part.sections``)."""
    return tuple(Part(name, (row,) + rest, rows, i) for i, row in enumerate(rows))


_L = "model.layers.{layer}"
_M = "decoder.layers.{layer}"

EMBEDDING = (
    Rule("embedding.word_embeddings.weight", (P("model.embed_tokens.weight", "vocab", "hidden"),),
         split=VOCAB, scope=MODEL, stage=FIRST),
)
OUTPUT = (
    Rule("decoder.final_layernorm.weight", (P("model.norm.weight", "hidden"),), scope=MODEL, stage=LAST),
    Rule("output_layer.weight", (P("lm_head.weight", "vocab", "hidden"),), split=VOCAB, scope=MODEL, stage=LAST,
         when="untied"),
    Rule("output_layer.weight", (P("model.embed_tokens.weight", "vocab", "hidden"),), split=VOCAB, scope=MODEL,
         stage=LAST, when="tied", tied_copy=True),
)
ATTENTION = (
    Rule(f"{_M}.input_layernorm.weight", (P(f"{_L}.input_layernorm.weight", "hidden"),),
         te_name=f"{_M}.self_attention.linear_qkv.layer_norm_weight"),
    Rule(f"{_M}.self_attention.linear_qkv.weight",
         (P(f"{_L}.self_attn.q_proj.weight", "q", "hidden"), P(f"{_L}.self_attn.k_proj.weight", "kv", "hidden"),
          P(f"{_L}.self_attn.v_proj.weight", "kv", "hidden")), join=QKV, split=COLUMN),
    Rule(f"{_M}.self_attention.linear_proj.weight", (P(f"{_L}.self_attn.o_proj.weight", "hidden", "q"),), split=ROW),
)
QKV_BIAS = (
    Rule(f"{_M}.self_attention.linear_qkv.bias",
         (P(f"{_L}.self_attn.q_proj.bias", "q"), P(f"{_L}.self_attn.k_proj.bias", "kv"),
          P(f"{_L}.self_attn.v_proj.bias", "kv")), join=QKV, split=COLUMN),
)
QK_NORM = (
    Rule(f"{_M}.self_attention.q_layernorm.weight", (P(f"{_L}.self_attn.q_norm.weight", "head_dim"),)),
    Rule(f"{_M}.self_attention.k_layernorm.weight", (P(f"{_L}.self_attn.k_norm.weight", "head_dim"),)),
)
DENSE_MLP = (
    Rule(f"{_M}.pre_mlp_layernorm.weight", (P(f"{_L}.post_attention_layernorm.weight", "hidden"),), scope=DENSE,
         te_name=f"{_M}.mlp.linear_fc1.layer_norm_weight"),
    Rule(f"{_M}.mlp.linear_fc1.weight",
         (P(f"{_L}.mlp.gate_proj.weight", "ffn", "hidden"), P(f"{_L}.mlp.up_proj.weight", "ffn", "hidden")),
         join=GLU, split=COLUMN, scope=DENSE),
    Rule(f"{_M}.mlp.linear_fc2.weight", (P(f"{_L}.mlp.down_proj.weight", "hidden", "ffn"),), split=ROW, scope=DENSE),
)
_E = f"{_M}.mlp.experts.local_experts.{{expert}}"
_HE = f"{_L}.mlp.experts.{{expert}}"
_GE = f"{_M}.mlp.experts"  # TEGroupedMLP: linear_fc1 / linear_fc2 are GroupedLinears, weight{i} per local expert
MOE_MLP = (
    # TE's MoE layers keep a separate pre-MLP norm, so its name is the same under both specs.
    Rule(f"{_M}.pre_mlp_layernorm.weight", (P(f"{_L}.post_attention_layernorm.weight", "hidden"),), scope=MOE),
    Rule(f"{_M}.mlp.router.weight", (P(f"{_L}.mlp.gate.weight", "experts", "hidden"),), scope=MOE),
    Rule(f"{_E}.linear_fc1.weight",
         (P(f"{_HE}.gate_proj.weight", "moe_ffn", "hidden"), P(f"{_HE}.up_proj.weight", "moe_ffn", "hidden")),
         join=GLU, split=COLUMN, scope=EXPERT, grouped=f"{_GE}.linear_fc1.weight{{expert}}"),
    Rule(f"{_E}.linear_fc2.weight", (P(f"{_HE}.down_proj.weight", "hidden", "moe_ffn"),), split=ROW, scope=EXPERT,
         grouped=f"{_GE}.linear_fc2.weight{{expert}}"),
)

# DeepSeek's multi-latent attention (megatron's MLASelfAttention). HF keeps each head's q rows as [nope; rope] and
# kv_b_proj's as [k nope; v], as megatron does; the rope dims are stored interleaved and megatron's MLA rope reads
# them so. TE fuses the q / kv latent norms into the up projections. The two down projections come back to back:
# SGLang fuses them on load (``LOADED_TOGETHER``). With ``mla_down_proj_fusion`` (megatron-core
# >= 0.19, q LoRA only) megatron's FusedMLASelfAttention holds both down projections as one
# ``linear_qkv_down_proj`` [q_lora + kv_lora + rope, hidden], column-parallel, each rank's rows [q_r; kv_r]
# (``FusedMLASelfAttention._qkv_down_projection`` splits a rank's output q_lora/TP, (kv_lora + rope)/TP and gathers
# each); under TE the decoder's input norm is fused into it too (``input_layernorm`` is then an IdentityOp).
_A, _HA = f"{_M}.self_attention", f"{_L}.self_attn"
_Q_DOWN = P(f"{_HA}.q_a_proj.weight", "q_lora", "hidden")
_KV_DOWN = P(f"{_HA}.kv_a_proj_with_mqa.weight", "kv_down", "hidden")
MLA_ATTENTION = (
    Rule(f"{_M}.input_layernorm.weight", (P(f"{_L}.input_layernorm.weight", "hidden"),),
         te_name=f"{_A}.linear_qkv_down_proj.layer_norm_weight"),
    Rule(f"{_A}.linear_q_down_proj.weight", (_Q_DOWN,), split=DOWN, when="q_down_proj"),
    Rule(f"{_A}.linear_kv_down_proj.weight", (_KV_DOWN,), split=DOWN, when="kv_down_proj"),
    Rule(f"{_A}.linear_qkv_down_proj.weight", (_Q_DOWN, _KV_DOWN), join=CAT, split=DOWN, when="qkv_down_proj"),
    Rule(f"{_A}.q_layernorm.weight", (P(f"{_HA}.q_a_layernorm.weight", "q_lora"),), when="q_lora",
         te_name=f"{_A}.linear_q_up_proj.layer_norm_weight"),
    Rule(f"{_A}.linear_q_up_proj.weight", (P(f"{_HA}.q_b_proj.weight", "q", "q_lora"),), split=COLUMN, when="q_lora"),
    Rule(f"{_A}.linear_q_proj.weight", (P(f"{_HA}.q_proj.weight", "q", "hidden"),), split=COLUMN, when="no_q_lora"),
    Rule(f"{_A}.kv_layernorm.weight", (P(f"{_HA}.kv_a_layernorm.weight", "kv_lora"),),
         te_name=f"{_A}.linear_kv_up_proj.layer_norm_weight"),
    Rule(f"{_A}.linear_kv_up_proj.weight", (P(f"{_HA}.kv_b_proj.weight", "kv_up", "kv_lora"),), split=COLUMN),
    Rule(f"{_A}.linear_proj.weight", (P(f"{_HA}.o_proj.weight", "hidden", "o_in"),), split=ROW),
)

# DeepSeek-V3 / GLM-4.5 MoE layers: the routing bias (megatron's router.expert_bias, a float32 buffer the router
# routes with) and the shared experts (split over TP like a dense MLP, not over expert ranks).
_HS = f"{_L}.mlp.shared_experts"
SIGMOID_MOE_MLP = MOE_MLP + (
    Rule(f"{_M}.mlp.router.expert_bias", (P(f"{_L}.mlp.gate.e_score_correction_bias", "experts"),), scope=MOE),
    Rule(f"{_M}.mlp.shared_experts.linear_fc1.weight",
         (P(f"{_HS}.gate_proj.weight", "shared_ffn", "hidden"), P(f"{_HS}.up_proj.weight", "shared_ffn", "hidden")),
         join=GLU, split=COLUMN, scope=MOE),
    Rule(f"{_M}.mlp.shared_experts.linear_fc2.weight", (P(f"{_HS}.down_proj.weight", "hidden", "shared_ffn"),),
         split=ROW, scope=MOE),
)


# DeepSeek sparse attention's indexer (model/dsa.py): megatron's DSAIndexer inside DSAttention (the MLA layer's
# core_attention), every projection held whole on every TP rank (duplicated); its key norm is a LayerNorm with a bias.
_IX, _HIX = f"{_A}.core_attention.indexer", f"{_HA}.indexer"
DSA_INDEXER = (
    Rule(f"{_IX}.linear_wq_b.weight", (P(f"{_HIX}.wq_b.weight", "index_q", "q_lora"),)),
    Rule(f"{_IX}.linear_wk.weight", (P(f"{_HIX}.wk.weight", "index_dim", "hidden"),)),
    Rule(f"{_IX}.k_norm.weight", (P(f"{_HIX}.k_norm.weight", "index_dim"),)),
    Rule(f"{_IX}.k_norm.bias", (P(f"{_HIX}.k_norm.bias", "index_dim"),)),
    Rule(f"{_IX}.linear_weights_proj.weight", (P(f"{_HIX}.weights_proj.weight", "index_heads", "hidden"),)),
)

# Qwen3.5 / Qwen3-Next full-attention layers (every 4th): q_proj emits each head's query and output gate, [q_h; g_h],
# which megatron's attention_output_gate holds per query group as [q heads; gate heads; k; v] ("gated_qkv"); q/k norm.
GATED_ATTENTION = (
    Rule(f"{_M}.input_layernorm.weight", (P(f"{_L}.input_layernorm.weight", "hidden"),), scope=FULL_ATTENTION,
         te_name=f"{_M}.self_attention.linear_qkv.layer_norm_weight"),
    Rule(f"{_M}.self_attention.linear_qkv.weight",
         (P(f"{_L}.self_attn.q_proj.weight", "q_gate", "hidden"), P(f"{_L}.self_attn.k_proj.weight", "kv", "hidden"),
          P(f"{_L}.self_attn.v_proj.weight", "kv", "hidden")), join=GATED_QKV, split=COLUMN, scope=FULL_ATTENTION),
    Rule(f"{_M}.self_attention.linear_proj.weight", (P(f"{_L}.self_attn.o_proj.weight", "hidden", "q"),), split=ROW,
         scope=FULL_ATTENTION),
    Rule(f"{_M}.self_attention.q_layernorm.weight", (P(f"{_L}.self_attn.q_norm.weight", "head_dim"),),
         scope=FULL_ATTENTION),
    Rule(f"{_M}.self_attention.k_layernorm.weight", (P(f"{_L}.self_attn.k_norm.weight", "head_dim"),),
         scope=FULL_ATTENTION),
)
# Their linear-attention layers: megatron's GatedDeltaNet (self_attention.*). Its in_proj holds, on TP rank r,
# [q_r; k_r; v_r; z_r; b_r; a_r] (each of HF's q, k, v sections of in_proj_qkv, in_proj_z, in_proj_b and in_proj_a
# split over TP on its own: whole key heads and their value heads on each rank), its conv1d [q_r; k_r; v_r] of
# HF's conv1d channels; A_log and dt_bias per value head; the gated output norm (plain, not zero-centred) per head.
_LA, _HLA = f"{_M}.self_attention", f"{_L}.linear_attn"
_QKV_ROWS = ("lin_qk", "lin_qk", "lin_v")
GATED_DELTANET = (
    Rule(f"{_M}.input_layernorm.weight", (P(f"{_L}.input_layernorm.weight", "hidden"),), scope=LINEAR_ATTENTION,
         te_name=f"{_LA}.in_proj.layer_norm_weight"),
    Rule(f"{_LA}.in_proj.weight",
         sections(f"{_HLA}.in_proj_qkv.weight", _QKV_ROWS, "hidden") + (
             P(f"{_HLA}.in_proj_z.weight", "lin_v", "hidden"), P(f"{_HLA}.in_proj_b.weight", "lin_heads", "hidden"),
             P(f"{_HLA}.in_proj_a.weight", "lin_heads", "hidden")), join=CAT, split=COLUMN, scope=LINEAR_ATTENTION),
    Rule(f"{_LA}.conv1d.weight", sections(f"{_HLA}.conv1d.weight", _QKV_ROWS, "one", "lin_kernel"), join=CAT,
         split=COLUMN, scope=LINEAR_ATTENTION),
    Rule(f"{_LA}.A_log", (P(f"{_HLA}.A_log", "lin_heads"),), split=COLUMN, scope=LINEAR_ATTENTION),
    Rule(f"{_LA}.dt_bias", (P(f"{_HLA}.dt_bias", "lin_heads"),), split=COLUMN, scope=LINEAR_ATTENTION),
    Rule(f"{_LA}.out_norm.weight", (P(f"{_HLA}.norm.weight", "lin_v_head"),), scope=LINEAR_ATTENTION),
    Rule(f"{_LA}.out_proj.weight", (P(f"{_HLA}.out_proj.weight", "hidden", "lin_v"),), split=ROW,
         scope=LINEAR_ATTENTION),
)
# Qwen3-Next's DeltaNet: the same but for in_proj, whose q, k, v, z rows come per key head in in_proj_qkvz and the b, a
# rows per key head in in_proj_ba (transformers' fix_query_key_value_ordering undoes it); TP splits whole key heads.
QWEN3_NEXT_DELTANET = tuple(
    Rule(rule.megatron, (Part(f"{_HLA}.in_proj_qkvz.weight", ("lin_qkvz", "hidden"),
                              per_head=("lin_k_head", "lin_k_head", "lin_v_per_k", "lin_v_per_k")),
                         Part(f"{_HLA}.in_proj_ba.weight", ("lin_ba", "hidden"),
                              per_head=("lin_heads_per_k", "lin_heads_per_k"))),
         join=PER_HEAD, split=COLUMN, scope=LINEAR_ATTENTION)
    if rule.megatron == f"{_LA}.in_proj.weight" else rule for rule in GATED_DELTANET)
# Qwen3.5 / Qwen3-Next MoE layers: one shared expert (split over TP like a dense MLP) whose output is scaled by
# sigmoid(x . shared_expert_gate): megatron's moe_shared_expert_gate, a [1, hidden] gate_weight.
_HSE = f"{_L}.mlp.shared_expert"
GATED_SHARED_MOE_MLP = MOE_MLP + (
    Rule(f"{_M}.mlp.shared_experts.linear_fc1.weight",
         (P(f"{_HSE}.gate_proj.weight", "shared_ffn", "hidden"), P(f"{_HSE}.up_proj.weight", "shared_ffn", "hidden")),
         join=GLU, split=COLUMN, scope=MOE),
    Rule(f"{_M}.mlp.shared_experts.linear_fc2.weight", (P(f"{_HSE}.down_proj.weight", "hidden", "shared_ffn"),),
         split=ROW, scope=MOE),
    Rule(f"{_M}.mlp.shared_experts.gate_weight", (P(f"{_L}.mlp.shared_expert_gate.weight", "one", "hidden"),),
         scope=MOE),
)
# gpt-oss (model/gpt_oss.py): biases on every linear, a sink logit per head (megatron's learnable softmax offset,
# split over TP with the heads), the router ``mlp.router`` with a bias, experts with biases. The expert names are the
# per-expert ones ``gpt_oss.ExpertsView`` shows (the files stack each layer's experts: ``STACKED_EXPERTS``).
_GE_FC1, _GE_FC2 = f"{_GE}.linear_fc1", f"{_GE}.linear_fc2"
GPT_OSS_ATTENTION = ATTENTION + QKV_BIAS + (
    Rule(f"{_M}.self_attention.linear_proj.bias", (P(f"{_L}.self_attn.o_proj.bias", "hidden"),)),
    Rule(f"{_M}.self_attention.core_attention.softmax_offset", (P(f"{_L}.self_attn.sinks", "heads"),), split=COLUMN),
)
GPT_OSS_MOE_MLP = (
    Rule(f"{_M}.pre_mlp_layernorm.weight", (P(f"{_L}.post_attention_layernorm.weight", "hidden"),), scope=MOE),
    Rule(f"{_M}.mlp.router.weight", (P(f"{_L}.mlp.router.weight", "experts", "hidden"),), scope=MOE),
    Rule(f"{_M}.mlp.router.bias", (P(f"{_L}.mlp.router.bias", "experts"),), scope=MOE),
    MOE_MLP[2],
    Rule(f"{_E}.linear_fc1.bias", (P(f"{_HE}.gate_proj.bias", "moe_ffn"), P(f"{_HE}.up_proj.bias", "moe_ffn")),
         join=GLU, split=COLUMN, scope=EXPERT, grouped=f"{_GE_FC1}.bias{{expert}}"),
    MOE_MLP[3],
    Rule(f"{_E}.linear_fc2.bias", (P(f"{_HE}.down_proj.bias", "hidden"),), scope=EXPERT,
         grouped=f"{_GE_FC2}.bias{{expert}}"),
)
# MiniMax-M2 (model/minimax_m2.py): q_norm / k_norm over the whole projection, split over TP with the heads (megatron's
# q/k_layernorm slot holds minimax_m2.WholeProjectionRMSNorm); MoE layers under block_sparse_moe with the routing bias
# beside the router (not in it), experts per expert as w1 (gate), w3 (up), w2 (down); no shared experts.
_HB, _HBE = f"{_L}.block_sparse_moe", f"{_L}.block_sparse_moe.experts.{{expert}}"
MINIMAX_M2_ATTENTION = ATTENTION + (
    Rule(f"{_M}.self_attention.q_layernorm.weight", (P(f"{_L}.self_attn.q_norm.weight", "q"),), split=COLUMN),
    Rule(f"{_M}.self_attention.k_layernorm.weight", (P(f"{_L}.self_attn.k_norm.weight", "kv"),), split=COLUMN),
)
MINIMAX_M2_MOE_MLP = (
    MOE_MLP[0],
    Rule(f"{_M}.mlp.router.weight", (P(f"{_HB}.gate.weight", "experts", "hidden"),), scope=MOE),
    Rule(f"{_M}.mlp.router.expert_bias", (P(f"{_HB}.e_score_correction_bias", "experts"),), scope=MOE),
    Rule(f"{_E}.linear_fc1.weight", (P(f"{_HBE}.w1.weight", "moe_ffn", "hidden"), P(f"{_HBE}.w3.weight", "moe_ffn",
                                                                                   "hidden")),
         join=GLU, split=COLUMN, scope=EXPERT, grouped=f"{_GE}.linear_fc1.weight{{expert}}"),
    Rule(f"{_E}.linear_fc2.weight", (P(f"{_HBE}.w2.weight", "hidden", "moe_ffn"),), split=ROW, scope=EXPERT,
         grouped=f"{_GE}.linear_fc2.weight{{expert}}"),
)
# Families whose checkpoints stack each layer's experts into one tensor per projection (gpt-oss): their rules name
# per-expert tensors, and gpt_oss converts on read (``ExpertsView``) and on export (``fuse_experts``).
STACKED_EXPERTS = ("gpt_oss",)


def _when(condition: str, rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    return tuple(dataclasses.replace(rule, when=condition) for rule in rules)


ARCHITECTURES: dict[str, tuple[Rule, ...]] = {
    "qwen3_moe": EMBEDDING + ATTENTION + QK_NORM + DENSE_MLP + MOE_MLP + OUTPUT,
    "qwen3": EMBEDDING + ATTENTION + QK_NORM + DENSE_MLP + OUTPUT,
    "qwen2": EMBEDDING + ATTENTION + QKV_BIAS + DENSE_MLP + OUTPUT,
    "llama": EMBEDDING + ATTENTION + DENSE_MLP + OUTPUT,
    "glm4_moe": (EMBEDDING + ATTENTION + _when("qkv_bias", QKV_BIAS) + _when("qk_norm", QK_NORM) + DENSE_MLP
                 + SIGMOID_MOE_MLP + OUTPUT),
    "deepseek_v3": EMBEDDING + MLA_ATTENTION + DENSE_MLP + SIGMOID_MOE_MLP + OUTPUT,
    "qwen3_5_text": EMBEDDING + GATED_ATTENTION + GATED_DELTANET + DENSE_MLP + OUTPUT,
    "qwen3_5_moe_text": EMBEDDING + GATED_ATTENTION + GATED_DELTANET + DENSE_MLP + GATED_SHARED_MOE_MLP + OUTPUT,
    "qwen3_next": EMBEDDING + GATED_ATTENTION + QWEN3_NEXT_DELTANET + DENSE_MLP + GATED_SHARED_MOE_MLP + OUTPUT,
    "gpt_oss": EMBEDDING + GPT_OSS_ATTENTION + GPT_OSS_MOE_MLP + OUTPUT,
    "glm_moe_dsa": EMBEDDING + MLA_ATTENTION + DSA_INDEXER + DENSE_MLP + SIGMOID_MOE_MLP + OUTPUT,
    "deepseek_v32": EMBEDDING + MLA_ATTENTION + DSA_INDEXER + DENSE_MLP + SIGMOID_MOE_MLP + OUTPUT,
    "minimax_m2": EMBEDDING + MINIMAX_M2_ATTENTION + MINIMAX_M2_MOE_MLP + OUTPUT,
}

# HF tensors SGLang's ``load_weights`` joins into one parameter only when both arrive in the same call, each a pair
# (first, second) of name suffixes: DeepSeek's q_a_proj and kv_a_proj_with_mqa make its fused_qkv_a_proj_with_mqa
# (where q LoRA is on), the first kept until the second comes, per call. A weight update calls it once per bucket:
# a bucket ending between the two leaves the fused parameter unwritten, silently (tests/rollout/
# test_deepseek_sglang_names.py). The export yields each pair back to back and ``ends_no_bucket`` holds the cut.
LOADED_TOGETHER = ((".self_attn.q_a_proj.weight", ".self_attn.kv_a_proj_with_mqa.weight"),)


def ends_no_bucket(name: str) -> bool:
    """A weight-sync bucket must not end after this HF tensor: its partner in ``LOADED_TOGETHER`` comes next, or,
    for a block-FP8 ``{weight}_scale_inv``, its weight (``fp8.quantized_stream`` sends the scale first; SGLang joins
    the fused layers' scales as their weights)."""
    return name.endswith("_scale_inv") or any(name.endswith(first) for first, _ in LOADED_TOGETHER)


# HF tensors the engine keeps in float32 whatever its dtype, as megatron does: the sigmoid router's correction bias
# (megatron's router.expert_bias, an fp32 buffer, updated in fp32; SGLang's DeepSeek MoEGate and Glm4MoeGate hold it
# as an fp32 parameter, transformers keeps it fp32 too). Cast to a bf16 engine's dtype, the engine would route with a
# rounded bias: other experts than the trainer's, silently. Every cast of an export goes through ``export_dtype``.
KEPT_FP32 = (".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias")


def export_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype HF tensor ``name`` leaves in when an export (weight sync, conversion) is cast to ``dtype``:
    float32 for ``KEPT_FP32``, ``dtype`` for other floating tensors, the tensor's own where ``dtype`` is None or it
    is not floating, or it is block-FP8 (a float8 weight or its fp32 ``weight_scale_inv``: ``model.fp8``)."""
    if name.endswith(KEPT_FP32):
        return torch.float32
    if tensor.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv"):
        return tensor.dtype
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


# HF tensors that hold no weights (old checkpoints saved RoPE tables): accepted and dropped.
IGNORED_HF_TENSORS = (re.compile(r"\.rotary_emb\.inv_freq$"),)


def rules_for(spec: ModelSpec, mla_down_proj_fusion: bool = False) -> tuple[Rule, ...]:
    """The rules that apply to this model (the family's table, filtered by tied / untied embeddings and the like).

    ``mla_down_proj_fusion``: the Megatron model holds MLA's down projections fused (its config's flag; the HF
    tensors are the same either way)."""
    table = ARCHITECTURES.get(spec.family)
    if table is None:
        raise UnsupportedModel(f"no tensor mapping for family {spec.family!r}; mapped: {', '.join(ARCHITECTURES)}")
    conditions = {None, "tied" if spec.tie_embeddings else "untied"}
    conditions |= {name for name in ("qkv_bias", "qk_norm") if getattr(spec, name)}
    conditions.add("q_lora" if spec.q_lora_rank else "no_q_lora")
    if mla_down_proj_fusion:
        conditions.add("qkv_down_proj")
    else:
        conditions |= {"kv_down_proj"} | ({"q_down_proj"} if spec.q_lora_rank else set())
    return tuple(rule for rule in table if rule.when in conditions)


def layers_in_scope(spec: ModelSpec, scope: str) -> list[int]:
    """Global layer indices a per-layer rule applies to."""
    if scope == LAYER:
        return list(range(spec.num_layers))
    if scope == DENSE:
        return [i for i in range(spec.num_layers) if not spec.is_moe_layer(i)]
    if scope in (MOE, EXPERT):
        return [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]
    if scope in (FULL_ATTENTION, LINEAR_ATTENTION):
        return [i for i in range(spec.num_layers) if spec.is_linear_attention_layer(i) == (scope == LINEAR_ATTENTION)]
    raise ValueError(f"scope {scope!r} is not per layer")


def hf_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the model and its shape: what a checkpoint must hold, no more, no less."""
    dims = spec.dims()
    shapes: dict[str, tuple[int, ...]] = {}
    for rule in rules_for(spec):
        if rule.tied_copy:
            continue
        if rule.scope == MODEL:
            instances = [{}]
        elif rule.scope == EXPERT:
            instances = [dict(layer=i, expert=e)
                         for i in layers_in_scope(spec, EXPERT) for e in range(spec.num_experts)]
        else:
            instances = [dict(layer=i) for i in layers_in_scope(spec, rule.scope)]
        for where in instances:
            for part in rule.hf:
                shape = (part.full_rows(dims),) + tuple(dims[d] for d in part.dims[1:])
                shapes[spec.checkpoint_name(part.name.format(**where))] = shape
    if spec.family in STACKED_EXPERTS:
        from .gpt_oss import stacked_shapes

        shapes = stacked_shapes(shapes)
    return shapes


def is_ignored(name: str) -> bool:
    return any(pattern.search(name) for pattern in IGNORED_HF_TENSORS)


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_LAYER_NAME = re.compile(r"^mtp\.(?:layers\.(\d+)\.)?")  # the one prefix (ModelSpec.mtp_prefix) in use


def mtp_layer_of(spec: ModelSpec, name: str) -> int | None:
    """The MTP layer an HF tensor belongs to (0-based), else None.

    DeepSeek-V3 and GLM-4.5 store their ``num_nextn_predict_layers`` multi-token-prediction layers as decoder layers
    after the last one (``model.layers.{num_hidden_layers + i}.*``); Qwen3-Next and Qwen3.5 under ``mtp.`` (its
    layers ``mtp.layers.{i}.*``, its fc / norms ``mtp.*``: layer 0). The policy does not build them: they are
    carried through conversion unchanged (never trained), and a checkpoint may lack them (transformers re-saves)."""
    if spec.mtp_prefix:
        match = _MTP_LAYER_NAME.match(name)
        return int(match.group(1) or 0) if match else None
    match = _LAYER_NAME.match(name.removeprefix(spec.weights_prefix))
    if not match or not spec.mtp_layers:
        return None
    index = int(match.group(1)) - spec.num_layers
    return index if 0 <= index < spec.mtp_layers else None


def is_carried(spec: ModelSpec, name: str) -> bool:
    """An HF tensor the policy does not hold, carried through conversion unchanged: an MTP layer's, or in a
    multimodal checkpoint one outside the language model's ``weights_prefix`` (Kimi-K2.5's vision tower and
    projector: not trained)."""
    return spec.is_outside_text_model(name) or mtp_layer_of(spec, name) is not None
