"""A Hugging Face ``config.json`` -> ``ModelSpec``: the numbers the Megatron model and the bridge need.

Supported families are a table (``FAMILIES``): what differs between Qwen3-MoE, Qwen3, Qwen2 and Llama is
data (q/k norm, qkv bias, MoE), not code paths. Config values that would need a feature the Megatron policy
does not map (sliding-window attention, biases on every linear, YaRN RoPE, ...) raise ``UnsupportedModel``
naming the field. The raw JSON is read, not a ``transformers`` config object, so conversion does not
depend on the installed ``transformers`` knowing the model.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import UnsupportedModel

# Megatron pads the vocabulary so every TP rank holds the same number of rows. The multiple is fixed (not
# 128 * tp as in Megatron-LM) so that one checkpoint reshards to any TP that divides it; real vocabularies
# (Qwen 151936, Llama-3 128256) are already multiples of 128, so they are not padded at all.
VOCAB_MULTIPLE = 128


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture and the Megatron features it maps to."""

    model_type: str
    architecture: str  # the *ForCausalLM class named in config.json "architectures"
    qk_norm: bool  # RMSNorm over head_dim on q and k (Qwen3)
    qkv_bias: bool  # biases on q/k/v projections only (Qwen2)
    moe: bool  # routed experts in (some) layers
    # config fields that must hold these values (anything else needs a Megatron feature we do not map)
    requires: dict[str, Any] = field(default_factory=dict)


_COMMON_REQUIRES = {"hidden_act": "silu", "use_sliding_window": False, "partial_rotary_factor": 1.0}

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
    )
}

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
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()  # per layer: True where the MLP is routed experts
    dtype: str = "float32"  # the config's weight dtype (informational: tensors carry their own)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and any(self.moe_layers)

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.moe_layers) if self.moe_layers else True

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def padded_vocab_size(self, multiple: int = VOCAB_MULTIPLE) -> int:
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def dims(self) -> dict[str, int]:
        """Symbolic tensor dimensions the mapping tables use (see ``mapping``)."""
        return {
            "hidden": self.hidden_size,
            "vocab": self.vocab_size,
            "q": self.num_attention_heads * self.head_dim,
            "kv": self.num_key_value_heads * self.head_dim,
            "head_dim": self.head_dim,
            "ffn": self.ffn_hidden_size,
            "moe_ffn": self.moe_ffn_hidden_size,
            "experts": self.num_experts,
        }

    def to_dict(self) -> dict:
        out = asdict(self)
        out["moe_layers"] = list(self.moe_layers)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        data = dict(data)
        data["moe_layers"] = tuple(data.get("moe_layers", ()))
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
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedModel(
            f"model_type={model_type!r} (architectures={config.get('architectures')}) is not supported; "
            f"supported model types: {', '.join(sorted(FAMILIES))}"
        )
    architectures = config.get("architectures") or [family.architecture]
    if family.architecture not in architectures:
        raise UnsupportedModel(
            f"architectures={architectures} for model_type={model_type!r}: only {family.architecture} "
            "(a causal LM) is supported"
        )
    return family


def _check_requires(config: dict, family: Family) -> None:
    for key, wanted in {**_COMMON_REQUIRES, **family.requires}.items():
        value = config.get(key)
        if value is None or value == wanted:
            continue
        raise UnsupportedModel(f"{key}={value!r} in config.json is not supported for {family.model_type} "
                               f"(only {wanted!r}): the Megatron policy does not map it")
    layer_types = config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedModel(f"layer_types={layer_types} in config.json: only full attention is supported "
                               "(sliding-window layers are not mapped)")


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


def _moe_layers(config: dict, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Qwen3-MoE's rule: layer i is MoE unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    if not num_experts:
        return tuple(False for _ in range(num_layers))
    mlp_only = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    return tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers))


def _int(config: dict, key: str, default=None) -> int:
    value = config.get(key, default)
    if value is None:
        raise UnsupportedModel(f"config.json has no {key}")
    return int(value)


def read_hf_config(config: dict | str | Path) -> ModelSpec:
    """A ``ModelSpec`` from an HF config dict, a ``config.json`` path or a directory holding one."""
    if not isinstance(config, dict):
        config = load_config_json(config)
    family = family_of(config)
    _check_requires(config, family)
    heads = _int(config, "num_attention_heads")
    hidden = _int(config, "hidden_size")
    num_layers = _int(config, "num_hidden_layers")
    head_dim = config.get("head_dim") or hidden // heads
    theta, scaling = _rope(config)
    num_experts = 0
    moe = {}
    if family.moe:
        # transformers 5 writes num_local_experts, the Qwen3-MoE hub configs num_experts.
        num_experts = _int(config, "num_experts", config.get("num_local_experts"))
        topk = _int(config, "num_experts_per_tok")
        norm_topk = bool(config.get("norm_topk_prob", False))
        if topk == 1 and norm_topk:
            raise UnsupportedModel("num_experts_per_tok=1 with norm_topk_prob=true is not supported: megatron-core "
                                   "needs a softmax before top-1 selection, which does not renormalise to 1")
        moe = dict(num_experts=num_experts, moe_ffn_hidden_size=_int(config, "moe_intermediate_size"),
                   moe_topk=topk, norm_topk_prob=norm_topk)
    return ModelSpec(
        family=family.model_type,
        vocab_size=_int(config, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        ffn_hidden_size=_int(config, "intermediate_size"),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling_factor=scaling,
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
        # Every supported family defaults to untied embeddings (transformers' PretrainedConfig would say True).
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=family.qk_norm,
        qkv_bias=family.qkv_bias,
        moe_layers=_moe_layers(config, num_layers, num_experts),
        dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        **moe,
    )


def spec_differences(a: ModelSpec, b: ModelSpec) -> list[str]:
    """Fields (other than the informational dtype) where two specs disagree, as 'field: a vs b'."""
    left, right = a.to_dict(), b.to_dict()
    return [f"{k}: {left[k]!r} vs {right[k]!r}" for k in left if k != "dtype" and left[k] != right[k]]
