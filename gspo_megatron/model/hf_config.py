"""A Hugging Face ``config.json`` -> ``ModelSpec``: the numbers the Megatron model and the bridge need.

Supported families are a table (``FAMILIES``): what differs between Qwen3-MoE, Qwen3, Qwen2, Llama and
GLM-4.5 is data (q/k norm, qkv bias, MoE, the router, partial rotary), not code paths; DeepSeek-V3's
multi-latent attention is a second attention (``Family.attention``) with its own fields. Config values that would need a feature the Megatron policy
does not map (sliding-window attention, biases on every linear, YaRN RoPE, ...) raise ``UnsupportedModel``
naming the field. The raw JSON is read, not a ``transformers`` config object, so conversion does not
depend on the installed ``transformers`` knowing the model.

One module although over 350 lines: the family table, the reading of the fields every family shares and the
per-field refusals are one mapping from ``config.json`` to ``ModelSpec``; most of the length is the table itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from .errors import UnsupportedModel
from .dsa import dsa_fields
from .gpt_oss import gpt_oss_fields
from .minimax_m2 import minimax_m2_fields

# Megatron pads the vocabulary so every TP rank holds the same number of rows. The multiple is fixed (not
# 128 * tp as in Megatron-LM) so that one checkpoint reshards to any TP that divides it; real vocabularies
# (Qwen 151936, Llama-3 128256) are already multiples of 128, so they are not padded at all.
VOCAB_MULTIPLE = 128


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture and the Megatron features it maps to."""

    model_type: str
    architecture: str  # the *ForCausalLM class named in config.json "architectures"
    # RMSNorm over head_dim on q and k (Qwen3): True / False, or the config key that says (GLM-4.5 use_qk_norm)
    qk_norm: bool | str
    qkv_bias: bool | str  # biases on q/k/v projections only (Qwen2), or the config key that says
    moe: bool  # routed experts in (some) layers
    # "softmax": Qwen3-MoE's softmax top-k. "sigmoid": DeepSeek-V3 / GLM-4.5's sigmoid scores, top-k chosen on
    # scores + e_score_correction_bias within the best topk_group of n_group groups, weights renormalised and
    # scaled by routed_scaling_factor; shared experts; the first first_k_dense_replace layers dense.
    router: str = "softmax"
    partial_rotary: bool = False  # partial_rotary_factor (RoPE on the first part of each head) is read
    # "gqa": grouped-query attention. "mla": DeepSeek's multi-latent attention (q / kv LoRA projections, a rope
    # part of each head shared by the keys, YaRN RoPE), megatron-core's MLATransformerConfig.
    attention: str = "gqa"
    # config fields that must hold these values (anything else needs a Megatron feature we do not map)
    requires: dict[str, Any] = field(default_factory=dict)
    # Fields SGLang's model class reads that transformers' config class does not define, so a transformers re-save
    # drops them (SGLang's DeepseekV2 then fails to build: "no attribute 'moe_layer_freq'"): with the value every
    # release of the family holds, written where an exported config lacks them (``serving_config``).
    serving_fields: dict[str, Any] = field(default_factory=dict)
    # Config values the family's model class hard-codes rather than reads (gpt-oss renormalises its top-k and sizes
    # its experts by intermediate_size; Qwen3.5-MoE always renormalises and has no norm_topk_prob field): read as if
    # config.json said them, where it does not.
    implied: dict[str, Any] = field(default_factory=dict)
    implied_from: dict[str, str] = field(default_factory=dict)  # {key: the config key whose value it takes}
    # gpt-oss: attention sinks, sliding-window layers (layer_types), biases on every linear (attention_bias), the
    # clamped GLU (swiglu_limit), GQA under YaRN RoPE; the module that reads its fields is model/gpt_oss.py.
    gpt_oss: bool = False
    # The gated-DeltaNet hybrids (Qwen3-Next, Qwen3.5): layer_types mixes "linear_attention" (megatron's
    # GatedDeltaNet) with "full_attention" layers whose q_proj also emits an output gate; every RMSNorm but the
    # DeltaNet's own is zero-centred (the checkpoint stores w, the norm applies 1 + w); the shared expert has a
    # sigmoid gate; MTP layers are stored as mtp.* (carried, not trained).
    gated_deltanet: bool = False
    # DeepSeek sparse attention (GLM-5, DeepSeek-V3.2): MLA plus an indexer choosing each query's index_topk keys
    # (index_n_heads, index_head_dim); the module that reads its fields is model/dsa.py.
    dsa: bool = False
    # MiniMax-M2: q/k RMSNorm over the whole projection (all heads together), not per head (model/minimax_m2.py)
    minimax_m2: bool = False


_COMMON_REQUIRES = {"hidden_act": "silu", "use_sliding_window": False}

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, qkv_bias=False, moe=True,
               requires={"attention_bias": False, "shared_expert_intermediate_size": 0}),
        Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, qkv_bias=False, moe=False,
               requires={"attention_bias": False}),
        Family("qwen2", "Qwen2ForCausalLM", qk_norm=False, qkv_bias=True, moe=False),
        Family("llama", "LlamaForCausalLM", qk_norm=False, qkv_bias=False, moe=False,
               requires={"attention_bias": False, "mlp_bias": False}),
        Family("glm4_moe", "Glm4MoeForCausalLM", qk_norm="use_qk_norm", qkv_bias="attention_bias", moe=True,
               router="sigmoid", partial_rotary=True, requires={"topk_method": "noaux_tc"}),
        # rope_interleave: megatron's MLA de-interleaves the rope dims, as DeepSeek's checkpoints need.
        Family("deepseek_v3", "DeepseekV3ForCausalLM", qk_norm=False, qkv_bias=False, moe=True, router="sigmoid",
               attention="mla", requires={"attention_bias": False, "topk_method": "noaux_tc", "moe_layer_freq": 1,
                                          "scoring_func": "sigmoid", "rope_interleave": True},
               serving_fields={"topk_method": "noaux_tc", "moe_layer_freq": 1, "scoring_func": "sigmoid"}),
        Family("qwen3_next", "Qwen3NextForCausalLM", qk_norm=True, qkv_bias=False, moe=True, partial_rotary=True,
               gated_deltanet=True, requires={"attention_bias": False}),
        # Qwen3.5's text models (their checkpoints are the vision-language wrappers in WRAPPERS)
        Family("qwen3_5_text", "Qwen3_5ForCausalLM", qk_norm=True, qkv_bias=False, moe=False, partial_rotary=True,
               gated_deltanet=True, requires={"attention_bias": False}),
        Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", qk_norm=True, qkv_bias=False, moe=True,
               partial_rotary=True, gated_deltanet=True, requires={"attention_bias": False, "norm_topk_prob": True},
               implied={"norm_topk_prob": True}),
        # gpt-oss: softmax over the top-k router logits (renormalised top-k), a router bias, experts fused in the files
        # (model/gpt_oss.py), every layer MoE.
        Family("gpt_oss", "GptOssForCausalLM", qk_norm=False, qkv_bias="attention_bias", moe=True, gpt_oss=True,
               implied={"norm_topk_prob": True}, implied_from={"moe_intermediate_size": "intermediate_size"}),
        # GLM-5 and DeepSeek-V3.2: DeepSeek-V3's MLA (rope always interleaved: their configs have no rope_interleave)
        # and router, with DeepSeek sparse attention (model/dsa.py); layer_types "indexed_attention" everywhere.
        Family("glm_moe_dsa", "GlmMoeDsaForCausalLM", qk_norm=False, qkv_bias=False, moe=True, router="sigmoid",
               attention="mla", dsa=True, requires={"attention_bias": False, "topk_method": "noaux_tc",
                                                    "scoring_func": "sigmoid"},
               serving_fields={"topk_method": "noaux_tc", "moe_layer_freq": 1, "scoring_func": "sigmoid"}),
        Family("deepseek_v32", "DeepseekV32ForCausalLM", qk_norm=False, qkv_bias=False, moe=True, router="sigmoid",
               attention="mla", dsa=True, requires={"attention_bias": False, "topk_method": "noaux_tc",
                                                    "scoring_func": "sigmoid"},
               serving_fields={"topk_method": "noaux_tc", "moe_layer_freq": 1, "scoring_func": "sigmoid"}),
        # MiniMax-M2: the sigmoid router with e_score_correction_bias, no groups or scaling, top-k always renormalised;
        # intermediate_size is the experts' width (every layer MoE); q/k norm over the whole projection; RoPE on
        # rotary_dim of each head. SGLang's MiniMaxM2 reads the four serving fields (defaults: off), transformers'
        # config drops them.
        Family("minimax_m2", "MiniMaxM2ForCausalLM", qk_norm=True, qkv_bias=False, moe=True, router="sigmoid",
               partial_rotary=True, minimax_m2=True,
               requires={"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
                         "qk_norm_type": "per_layer", "shared_intermediate_size": 0, "attention_bias": False},
               implied={"norm_topk_prob": True}, implied_from={"moe_intermediate_size": "intermediate_size"},
               serving_fields={"scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
                               "qk_norm_type": "per_layer"}),
    )
}
# model types read as another family: Kimi-K2 is the DeepSeek-V3 architecture (transformers has no config class for it)
ALIASES = {"kimi_k2": "deepseek_v3"}
# Multimodal wrappers whose text model we train: (its config key, the prefix of its tensors). Kimi-K2.5 (SGLang's
# KimiK25ForConditionalGeneration) holds a kimi_k2 text model as language_model.model.* / language_model.lm_head.*
# beside vision_tower.* and mm_projector.*.
WRAPPERS = {"kimi_k25": ("text_config", "language_model.")}
# Wrappers whose text model's tensors sit under the wrapper's own ``model.`` (Qwen3.5's
# Qwen3_5(Moe)ForConditionalGeneration: model.language_model.* beside model.visual.*, the head at lm_head.*, MTP
# layers at mtp.*): the causal LM's ``model.`` becomes this prefix; everything else keeps its name.
TEXT_MODEL_WRAPPERS = {"qwen3_5": ("text_config", "model.language_model."),
                       "qwen3_5_moe": ("text_config", "model.language_model.")}
# Text models that transformers may save under their wrapper's prefix: loading Qwen3.5's release as
# Qwen3_5(Moe)ForCausalLM renames model.language_model.* to model.* (its conversion_mapping's PrefixChange), and
# save_pretrained reverses the rename, so a fine-tuned re-save holds model.language_model.* beside lm_head.*; a model
# built fresh saves model.*. transformers and SGLang load both: the checkpoint's tensor names say which
# (ModelSpec.named_as).
RESAVED_UNDER = {"qwen3_5_text": "model.language_model.", "qwen3_5_moe_text": "model.language_model."}

# Llama-3.1 style frequency scaling as megatron-core implements it (its constants are fixed).
_LLAMA3_ROPE_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as both sides see it. Built by ``read_hf_config``."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int  # dense MLP width (HF intermediate_size)
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    rope_scaling_factor: float | None = None  # Llama-3.1 style scaling, None for plain RoPE
    rotary_percent: float = 1.0  # the share of each head RoPE rotates (GLM-4.5 partial_rotary_factor 0.5)
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()  # per layer: True where the MLP is routed experts
    moe_router: str = "softmax"  # Family.router
    moe_shared_ffn_hidden_size: int = 0  # n_shared_experts * moe_intermediate_size, always-on experts
    moe_router_groups: int = 1  # n_group: experts in this many groups ...
    moe_router_group_topk: int = 1  # topk_group: ... of which the best this many are chosen from
    moe_scaling_factor: float = 1.0  # routed_scaling_factor on the routing weights
    mtp_layers: int = 0  # num_nextn_predict_layers: not part of the policy (see mapping.mtp_layer_of)
    # Multi-latent attention (attention == "mla"; head_dim is then qk_nope_head_dim + qk_rope_head_dim).
    attention: str = "gqa"
    q_lora_rank: int = 0  # 0: no q LoRA (one q_proj, as in Moonlight)
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # YaRN RoPE (rope_type "yarn"): the factor, None for none, and its constants
    yarn_factor: float | None = None
    yarn_original_max_position_embeddings: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_truncate: bool = True  # YaRN's correction range rounded to whole dims (gpt-oss: false)
    # gpt-oss (model/gpt_oss.py): a learnt sink logit per head in every softmax; sliding-window attention over the
    # last sliding_window keys (the query's own included) in the layers marked True; biases on every linear (attention,
    # router, experts); the experts' GLU clamped at glu_clamp with (up + 1) * gate * sigmoid(1.702 gate).
    attention_sinks: bool = False
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    linear_bias: bool = False
    glu_clamp: float | None = None
    dtype: str = "float32"  # the config's weight dtype (informational: tensors carry their own)
    # Where the language model's tensors sit in a multimodal checkpoint (Kimi-K2.5: "language_model."): every
    # mapped HF name carries it; tensors outside it (the vision tower) are not trained (mapping.is_carried).
    weights_prefix: str = ""
    # Where the causal LM's ``model.`` sits in a multimodal checkpoint whose head stays at ``lm_head.`` (Qwen3.5:
    # "model.language_model."); tensors outside both (the vision tower, mtp.*) are carried.
    text_model_prefix: str = ""
    # Gated-DeltaNet hybrids (Family.gated_deltanet): per layer, True where it is a linear-attention layer
    linear_attention_layers: tuple[bool, ...] = ()
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    attention_output_gate: bool = False  # q_proj emits [query; gate] per head; out = attn * sigmoid(gate)
    zero_centered_norm: bool = False  # RMSNorms apply (1 + w): megatron's layernorm_zero_centered_gamma
    moe_shared_expert_gate: bool = False  # shared expert output * sigmoid(x @ shared_expert_gate)
    mtp_prefix: str = ""  # MTP tensors stored apart from the decoder layers (Qwen3-Next / 3.5: "mtp.")
    # DeepSeek sparse attention (Family.dsa, model/dsa.py): each query attends to the dsa_index_topk earlier tokens its
    # indexer (dsa_index_heads heads of dsa_index_head_dim) scores highest; 0: dense attention
    dsa_index_heads: int = 0
    dsa_index_head_dim: int = 0
    dsa_index_topk: int = 0
    dsa_indexer_rope_interleaved: bool = False
    # MiniMax-M2 (model/minimax_m2.py): q_norm / k_norm over all heads of the projection at once (qk_norm too)
    qk_norm_whole_projection: bool = False

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and any(self.moe_layers)

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.moe_layers) if self.moe_layers else True

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def is_linear_attention_layer(self, layer: int) -> bool:
        return bool(self.linear_attention_layers) and self.linear_attention_layers[layer]

    def checkpoint_name(self, name: str) -> str:
        """A causal LM's tensor name (``model.layers.0...``, ``lm_head.weight``) as this checkpoint stores it."""
        if self.text_model_prefix and name.startswith("model."):
            return self.text_model_prefix + name.removeprefix("model.")
        return self.weights_prefix + name

    def is_outside_text_model(self, name: str) -> bool:
        """A checkpoint tensor that is not the language model's (a multimodal checkpoint's vision tower)."""
        if self.text_model_prefix:
            return not name.startswith((self.text_model_prefix, "lm_head."))
        return bool(self.weights_prefix) and not name.startswith(self.weights_prefix)

    def named_as(self, tensor_names: Iterable[str]) -> "ModelSpec":
        """This spec with its text model's tensors where a checkpoint holding ``tensor_names`` keeps them (its config
        alone cannot say: ``RESAVED_UNDER``)."""
        prefix = RESAVED_UNDER.get(self.family) if not self.text_model_prefix else None
        if prefix and any(name.startswith(prefix) for name in tensor_names):
            return replace(self, text_model_prefix=prefix)
        return self

    def padded_vocab_size(self, multiple: int = VOCAB_MULTIPLE) -> int:
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def _value_heads_per_key_head(self) -> int:
        return self.linear_num_value_heads // max(self.linear_num_key_heads, 1)

    def dims(self) -> dict[str, int]:
        """Symbolic tensor dimensions the mapping tables use (see ``mapping``)."""
        return {
            "hidden": self.hidden_size,
            "vocab": self.vocab_size,
            "heads": self.num_attention_heads,
            "q": self.num_attention_heads * self.head_dim,
            "kv": self.num_key_value_heads * self.head_dim,
            "head_dim": self.head_dim,
            "ffn": self.ffn_hidden_size,
            "moe_ffn": self.moe_ffn_hidden_size,
            "shared_ffn": self.moe_shared_ffn_hidden_size,
            "experts": self.num_experts,
            # multi-latent attention
            "q_lora": self.q_lora_rank,
            "kv_lora": self.kv_lora_rank,
            "kv_down": self.kv_lora_rank + self.qk_rope_head_dim,  # the kv latent and the shared rope key
            "kv_up": self.num_attention_heads * (self.head_dim - self.qk_rope_head_dim + self.v_head_dim),
            "o_in": self.num_attention_heads * self.v_head_dim,
            # gated attention: q_proj holds [query; gate] per head
            "q_gate": 2 * self.num_attention_heads * self.head_dim,
            # gated DeltaNet (linear attention)
            "lin_qk": self.linear_num_key_heads * self.linear_key_head_dim,
            "lin_v": self.linear_num_value_heads * self.linear_value_head_dim,
            "lin_qkv": 2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim,
            "lin_heads": self.linear_num_value_heads,
            # Qwen3-Next's per-key-head layout of in_proj_qkvz ([q; k; v; z] per key head) and in_proj_ba ([b; a])
            "lin_qkvz": 2 * self.linear_num_key_heads * self.linear_key_head_dim
            + 2 * self.linear_num_value_heads * self.linear_value_head_dim,
            "lin_ba": 2 * self.linear_num_value_heads,
            "lin_k_head": self.linear_key_head_dim,
            "lin_heads_per_k": self._value_heads_per_key_head(),
            "lin_v_per_k": self._value_heads_per_key_head() * self.linear_value_head_dim,
            "lin_v_head": self.linear_value_head_dim,
            "lin_kernel": self.linear_conv_kernel_dim,
            "one": 1,
            # DeepSeek sparse attention's indexer
            "index_q": self.dsa_index_heads * self.dsa_index_head_dim,
            "index_dim": self.dsa_index_head_dim,
            "index_heads": self.dsa_index_heads,
        }

    def to_dict(self) -> dict:
        out = asdict(self)
        out["moe_layers"] = list(self.moe_layers)
        out["linear_attention_layers"] = list(self.linear_attention_layers)
        out["sliding_layers"] = list(self.sliding_layers)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        data = dict(data)
        data["moe_layers"] = tuple(data.get("moe_layers", ()))
        data["linear_attention_layers"] = tuple(data.get("linear_attention_layers", ()))
        data["sliding_layers"] = tuple(data.get("sliding_layers", ()))
        return cls(**data)


def load_config_json(path: str | Path) -> dict:
    """``config.json`` of an HF directory (or the file itself) as a dict."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {file}: expected a directory holding config.json")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); is the file truncated?") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object of config fields")
    return config


def family_of(config: dict) -> Family:
    model_type = config.get("model_type")
    family = FAMILIES.get(ALIASES.get(model_type, model_type))
    if family is None:
        raise UnsupportedModel(
            f"model_type={model_type!r} (architectures={config.get('architectures')}) is not supported; "
            f"supported model types: {', '.join(sorted([*FAMILIES, *ALIASES, *WRAPPERS, *TEXT_MODEL_WRAPPERS]))}"
        )
    architectures = config.get("architectures") or [family.architecture]
    if family.architecture not in architectures:
        raise UnsupportedModel(
            f"architectures={architectures} for model_type={model_type!r}: only {family.architecture} "
            "(a causal LM) is supported"
        )
    return family


def serving_config(config: dict) -> dict:
    """``config`` with its family's ``serving_fields`` added where it lacks them (what an export writes); in a
    multimodal wrapper (``WRAPPERS``), to its text model's config, which is what SGLang's language model reads."""
    wrapper = _wrapper(config)
    if wrapper:
        return {**config, wrapper[0]: serving_config(text_config(config))}
    family = family_of(config)
    derived = {}
    if family.minimax_m2:  # SGLang's MiniMaxM2 rotates rotary_dim dims of each head (default: all of them)
        head_dim = int(config.get("head_dim") or _int(config, "hidden_size") // _int(config, "num_attention_heads"))
        derived["rotary_dim"] = int(head_dim * _rotary_percent(config, family))
    out = {**family.serving_fields, **derived, **config}
    # SGLang's own Qwen3NextConfig (Qwen3.5's text configs derive from it) places its layers by
    # full_attention_interval alone (the releases have it); transformers 5.19 saves layer_types instead.
    if out.get("model_type") in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text") \
            and "full_attention_interval" not in out:
        full = [i for i, t in enumerate(out.get("layer_types") or []) if t == "full_attention"]
        if full and full == list(range(full[0], len(out["layer_types"]), full[0] + 1)):
            out["full_attention_interval"] = full[0] + 1
    return out


def _check_requires(config: dict, family: Family) -> None:
    for key, wanted in {**_COMMON_REQUIRES, **family.requires}.items():
        value = config.get(key)
        if value is None or value == wanted:
            continue
        raise UnsupportedModel(f"{key}={value!r} in config.json is not supported for {family.model_type} "
                               f"(only {wanted!r}): the Megatron policy does not map it")
    layer_types = config.get("layer_types") or []
    allowed = {"full_attention", "linear_attention"} if family.gated_deltanet else {"full_attention"}
    allowed |= {"indexed_attention"} if family.dsa else set()
    if not family.gpt_oss and any(t not in allowed for t in layer_types):  # (gpt_oss.py reads its sliding layers)
        raise UnsupportedModel(f"layer_types={layer_types} in config.json: only {' and '.join(sorted(allowed))} "
                               f"layers are supported for {family.model_type} (sliding-window layers are not mapped)")


_YARN_FIELDS = {"factor": "yarn_factor", "original_max_position_embeddings": "yarn_original_max_position_embeddings",
                "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow", "mscale": "yarn_mscale",
                "mscale_all_dim": "yarn_mscale_all_dim"}


def _rope_fields(config: dict, family: Family) -> dict:
    """ModelSpec's RoPE fields: theta, Llama-3 scaling, or (multi-latent attention only) YaRN."""
    merged = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if (merged.get("rope_type") or merged.get("type")) != "yarn" or not (family.attention == "mla" or family.gpt_oss):
        theta, scaling = _rope(config)
        return dict(rope_theta=theta, rope_scaling_factor=scaling)
    unknown = set(merged) - set(_YARN_FIELDS) - {"rope_type", "type", "rope_theta", "attention_factor", "truncate"}
    # truncate=false (gpt-oss) is megatron's yarn_correction_range_round_to_int=False, which only its GQA YaRN reads
    truncate_ok = merged.get("truncate", True) is True or family.attention == "gqa"
    if unknown or merged.get("attention_factor") is not None or not truncate_ok:
        raise UnsupportedModel(f"rope_parameters={merged}: megatron-core's YaRN takes factor, "
                               "original_max_position_embeddings, beta_fast, beta_slow, mscale and mscale_all_dim only")
    fields = {ours: float(merged[theirs]) for theirs, ours in _YARN_FIELDS.items() if merged.get(theirs) is not None}
    fields["yarn_truncate"] = bool(merged.get("truncate", True))
    fields["yarn_original_max_position_embeddings"] = int(merged.get("original_max_position_embeddings")
                                                          or config.get("max_position_embeddings") or 4096)
    theta = float(merged.get("rope_theta", config.get("rope_theta", 10000.0)))
    return dict(rope_theta=theta, **fields)


def _mla_fields(config: dict) -> dict:
    """Multi-latent attention's dims (DeepSeek-V3: q LoRA 1536 or none, kv LoRA 512, nope 128, rope 64, v 128)."""
    nope, rope = _int(config, "qk_nope_head_dim"), _int(config, "qk_rope_head_dim")
    return dict(attention="mla", q_lora_rank=int(config.get("q_lora_rank") or 0),
                kv_lora_rank=_int(config, "kv_lora_rank"), qk_rope_head_dim=rope,
                v_head_dim=_int(config, "v_head_dim"), head_dim=nope + rope)


def _rope(config: dict) -> tuple[float, float | None]:
    """(theta, Llama-3 scaling factor or None) from transformers-5 ``rope_parameters`` or legacy fields."""
    params = config.get("rope_parameters") or {}
    legacy = config.get("rope_scaling") or {}
    if params and "rope_theta" not in params and "rope_type" not in params:
        raise UnsupportedModel(f"rope_parameters={params} (per layer type) is not supported: one RoPE for all layers")
    merged = {**legacy, **params}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        for key, wanted in _LLAMA3_ROPE_CONSTANTS.items():
            if float(merged.get(key, wanted)) != wanted:
                raise UnsupportedModel(
                    f"rope_parameters.{key}={merged.get(key)} is not supported: megatron-core's Llama-3 RoPE "
                    f"scaling fixes it to {wanted}"
                )
        return theta, float(merged["factor"])
    raise UnsupportedModel(f"rope_parameters.rope_type={rope_type!r} is not supported (supported: default, llama3)")


def _rotary_percent(config: dict, family: Family) -> float:
    """partial_rotary_factor: top level in released GLM configs, inside rope_parameters in transformers-5 saves;
    rotary_dim / head_dim in MiniMax-M2's."""
    top, inner = config.get("partial_rotary_factor"), (config.get("rope_parameters") or {}).get("partial_rotary_factor")
    if top is None and config.get("rotary_dim") is not None:  # MiniMax-M2's release: rotary_dim of head_dim
        top = int(config["rotary_dim"]) / int(config.get("head_dim") or _int(config, "hidden_size")
                                              // _int(config, "num_attention_heads"))
    if top is not None and inner is not None and float(top) != float(inner):
        raise UnsupportedModel(f"partial_rotary_factor={top} but rope_parameters.partial_rotary_factor={inner}")
    value = float(inner if inner is not None else top if top is not None else 1.0)
    if value != 1.0 and not family.partial_rotary:
        raise UnsupportedModel(f"partial_rotary_factor={value!r} in config.json is not supported for "
                               f"{family.model_type} (only 1.0): the Megatron policy does not map it")
    return value


def _flag(config: dict, value: bool | str) -> bool:
    """A Family flag: fixed, or read from the config key it names (absent: False)."""
    return bool(config.get(value, False)) if isinstance(value, str) else value


def _sigmoid_router(config: dict, topk: int, num_experts: int) -> dict:
    """DeepSeek-V3 / GLM-4.5 routing as megatron-core's sigmoid router with expert bias, or refuse by field."""
    if not config.get("norm_topk_prob", False) or topk == 1:
        raise UnsupportedModel(f"norm_topk_prob={config.get('norm_topk_prob')} with num_experts_per_tok={topk} is not "
                               "supported for a sigmoid router: megatron-core renormalises the top-k sigmoid scores "
                               "exactly when top-k > 1")
    groups, group_topk = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
    if groups > 1:
        if num_experts % groups or topk % group_topk or topk // group_topk != 2:
            # HF ranks groups by the sum of their best 2 scores; megatron by the best topk / topk_group.
            raise UnsupportedModel(f"n_group={groups}, topk_group={group_topk} with num_experts_per_tok={topk}: "
                                   "megatron-core ranks a group by its best num_experts_per_tok / topk_group scores, "
                                   "the HF models by their best 2; only configs where the two agree are supported")
    elif group_topk != 1:
        raise UnsupportedModel(f"topk_group={group_topk} with n_group={groups}: one group has only itself to choose")
    shared = int(config.get("n_shared_experts") or 0)
    return dict(moe_router="sigmoid", moe_router_groups=groups, moe_router_group_topk=group_topk,
                moe_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
                moe_shared_ffn_hidden_size=shared * _int(config, "moe_intermediate_size"))


def _moe_layers(config: dict, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Qwen3-MoE's rule: layer i is MoE unless listed in mlp_only_layers, every decoder_sparse_step-th layer.
    DeepSeek-V3 / GLM-4.5's: the first first_k_dense_replace layers are dense, every later one MoE."""
    if not num_experts:
        return tuple(False for _ in range(num_layers))
    if "first_k_dense_replace" in config:
        return tuple(i >= int(config["first_k_dense_replace"] or 0) for i in range(num_layers))
    mlp_only = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    return tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers))


def _int(config: dict, key: str, default=None) -> int:
    value = config.get(key, default)
    if value is None:
        raise UnsupportedModel(f"config.json has no {key}")
    return int(value)


def _wrapper(config: dict) -> tuple[str, str] | None:
    model_type = config.get("model_type")
    return WRAPPERS.get(model_type) or TEXT_MODEL_WRAPPERS.get(model_type)


def text_config(config: dict) -> dict:
    """The config of the model the policy trains: a multimodal wrapper's text model (``WRAPPERS``,
    ``TEXT_MODEL_WRAPPERS``), else ``config``."""
    wrapper = _wrapper(config)
    if wrapper is None:
        return config
    key = wrapper[0]
    text = config.get(key)
    if not isinstance(text, dict):
        raise UnsupportedModel(f"model_type={config['model_type']!r} without a {key} object: its text model is what "
                               "the policy trains")
    return text


def read_hf_config(config: dict | str | Path) -> ModelSpec:
    """A ``ModelSpec`` from an HF config dict, a ``config.json`` path or a directory holding one."""
    if not isinstance(config, dict):
        config = load_config_json(config)
    if config.get("model_type") in WRAPPERS:
        return replace(read_hf_config(text_config(config)), weights_prefix=WRAPPERS[config["model_type"]][1])
    if config.get("model_type") in TEXT_MODEL_WRAPPERS:
        return replace(read_hf_config(text_config(config)),
                       text_model_prefix=TEXT_MODEL_WRAPPERS[config["model_type"]][1])
    family = family_of(config)
    config = {**family.implied, **{k: config[v] for k, v in family.implied_from.items() if v in config}, **config}
    _check_requires(config, family)
    heads = _int(config, "num_attention_heads")
    hidden = _int(config, "hidden_size")
    num_layers = _int(config, "num_hidden_layers")
    head_dim = config.get("head_dim") or hidden // heads
    attention = dict(head_dim=int(head_dim)) if family.attention == "gqa" else _mla_fields(config)
    num_experts = 0
    moe = {}
    if family.moe:
        # transformers 5 writes num_local_experts, the Qwen3-MoE hub configs num_experts, DeepSeek / GLM n_routed_experts.
        num_experts = _int(config, "num_experts", config.get("num_local_experts", config.get("n_routed_experts")))
        topk = _int(config, "num_experts_per_tok")
        norm_topk = bool(config.get("norm_topk_prob", False))
        if family.router == "sigmoid":
            moe = _sigmoid_router(config, topk, num_experts)
        elif topk == 1 and norm_topk:
            raise UnsupportedModel("num_experts_per_tok=1 with norm_topk_prob=true is not supported: megatron-core "
                                   "needs a softmax before top-1 selection, which does not renormalise to 1")
        moe.update(num_experts=num_experts, moe_ffn_hidden_size=_int(config, "moe_intermediate_size"),
                   moe_topk=topk, norm_topk_prob=norm_topk)
        if family.gated_deltanet:
            moe.update(moe_shared_ffn_hidden_size=_int(config, "shared_expert_intermediate_size"),
                       moe_shared_expert_gate=True)
    hybrid = _gated_deltanet_fields(config, num_layers) if family.gated_deltanet else {}
    return ModelSpec(
        family=family.model_type,
        vocab_size=_int(config, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        ffn_hidden_size=_ffn_hidden_size(config, num_layers, num_experts),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        **_rope_fields(config, family),
        **attention,
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
        # Every supported family defaults to untied embeddings (transformers' PretrainedConfig would say True).
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=_flag(config, family.qk_norm),
        qkv_bias=_flag(config, family.qkv_bias),
        rotary_percent=_rotary_percent(config, family),
        # hub configs say num_nextn_predict_layers (Qwen3-Next / 3.5: mtp_num_hidden_layers), transformers'
        # DeepseekV3Config num_mtp_layers
        mtp_layers=int(config.get("num_nextn_predict_layers") or config.get("num_mtp_layers")
                       or config.get("mtp_num_hidden_layers") or config.get("num_mtp_modules") or 0),
        moe_layers=_moe_layers(config, num_layers, num_experts),
        dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        **moe,
        **hybrid,
        **(gpt_oss_fields(config, num_layers) if family.gpt_oss else {}),
        **(dsa_fields(config, family.model_type, num_layers) if family.dsa else {}),
        **(minimax_m2_fields(config, num_layers) if family.minimax_m2 else {}),
    )


def _ffn_hidden_size(config: dict, num_layers: int, num_experts: int) -> int:
    """The dense MLP width; a model whose every layer is MoE may leave it out (Qwen3.5-MoE's text configs do), and
    then megatron is given the experts' width, which builds nothing (no dense MLP)."""
    if "intermediate_size" in config or not all(_moe_layers(config, num_layers, num_experts)):
        return _int(config, "intermediate_size")
    return _int(config, "moe_intermediate_size")


def _gated_deltanet_fields(config: dict, num_layers: int) -> dict:
    """Qwen3-Next / Qwen3.5: which layers are linear attention (``layer_types``, else every
    ``full_attention_interval``-th layer is full attention, as transformers derives it) and the DeltaNet's dims."""
    layer_types = config.get("layer_types")
    if not layer_types:
        interval = int(config.get("full_attention_interval") or 4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise UnsupportedModel(f"layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}")
    fields = dict(linear_attention_layers=tuple(t == "linear_attention" for t in layer_types),
                  attention_output_gate=True, zero_centered_norm=True, mtp_prefix="mtp.")
    for key in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                "linear_num_value_heads"):
        fields[key] = _int(config, key)
    if fields["linear_num_value_heads"] % fields["linear_num_key_heads"]:
        raise UnsupportedModel(f"linear_num_value_heads={fields['linear_num_value_heads']} is not a multiple of "
                               f"linear_num_key_heads={fields['linear_num_key_heads']}")
    return fields


def spec_differences(a: ModelSpec, b: ModelSpec) -> list[str]:
    """Fields (other than the informational dtype) where two specs disagree, as 'field: a vs b'."""
    left, right = a.to_dict(), b.to_dict()
    return [f"{k}: {left[k]!r} vs {right[k]!r}" for k in left if k != "dtype" and left[k] != right[k]]
