"""DeepSeek sparse attention (GLM-5 ``glm_moe_dsa``, DeepSeek-V3.2 ``deepseek_v32``): multi-latent attention whose
queries attend only to the ``index_topk`` earlier tokens a small "lightning indexer" picks for each of them.

The indexer (transformers' ``DeepseekV32Indexer``, megatron-core 0.19's ``DSAIndexer``): ``wq_b`` maps the q latent
(after ``q_a_layernorm``) to ``index_n_heads`` heads of ``index_head_dim``, ``wk`` the hidden state to one key of
``index_head_dim`` (then a LayerNorm with bias, eps 1e-6), RoPE on the first ``qk_rope_head_dim`` dims of both
(interleaved for GLM-5, half-split for DeepSeek-V3.2; ``indexer_rope_interleave`` in config.json says so where
present, as SGLang reads it), and ``weights_proj`` one weight per head:
``score[s, t] = sum_h w[s, h] / sqrt(H) * relu(q[s, h] . k[t] / sqrt(D))``; each query keeps the top-k causal keys.
megatron-core's ``dsa_indexer_rotate_activation`` (a Hadamard rotation of q and k before scoring) is off: it
preserves dot products, needs bf16 and ``fast_hadamard_transform``, and transformers skips it too.

megatron builds a DSA layer as ``AbsorbedMLASelfAttention`` (kv_b_proj's key rows absorbed into the query: the same
weights, ``linear_kv_up_proj``) over ``DSAttention`` (``core_attention``) holding the ``DSAIndexer``. Its own spec
(``experimental_attention_variant_module_specs``) asserts TransformerEngine; ``dsa_spec`` builds the same modules
on the local spec for the CPU (``dsa_kernel_backend='none'``: megatron's PyTorch sparse attention; ``kernel_backend``).

The RL update and the indexer: megatron detaches the indexer's inputs, so the policy loss never reaches it; its only
gradient is its own KL loss towards the attention scores (``dsa_indexer_loss_coeff``). Here the indexer is frozen
(``freeze_indexer``): the top-k it picks stays what the rollout engine was given, and weight decay cannot move
weights that no loss trains.
"""

from __future__ import annotations

import dataclasses
from importlib.metadata import version

import torch

from .errors import UnsupportedModel

# config.json fields of the family -> (whether the indexer's RoPE is interleaved where the config does not say)
INDEXER_ROPE_INTERLEAVED = {"glm_moe_dsa": True, "deepseek_v32": False}
INDEXER_K_NORM_EPS = 1e-6  # transformers' and the reference's indexer LayerNorm


def dsa_fields(config: dict, family: str, num_layers: int) -> dict:
    """ModelSpec's DSA fields from config.json, or ``UnsupportedModel`` naming the field."""
    if not config.get("q_lora_rank"):
        raise UnsupportedModel(f"q_lora_rank={config.get('q_lora_rank')!r} for {family}: its indexer reads the q "
                               "latent, so DeepSeek sparse attention needs q LoRA")
    types = config.get("indexer_types") or ["full"] * num_layers
    pattern = config.get("index_topk_pattern")
    if any(t != "full" for t in types) or int(config.get("index_topk_freq") or 1) > 1 or (pattern and "S" in pattern):
        raise UnsupportedModel(f"indexer_types={types} in config.json: only layers that run their own indexer "
                               "('full') are supported (cross-layer top-k sharing is not mapped)")
    heads, dim, topk = (int(config[k]) for k in ("index_n_heads", "index_head_dim", "index_topk"))
    rope = int(config["qk_rope_head_dim"])
    if dim < rope:
        raise UnsupportedModel(f"index_head_dim={dim} < qk_rope_head_dim={rope}: the indexer rotates its first "
                               "qk_rope_head_dim dims")
    dense = int(config.get("first_k_dense_replace") or 0)
    mlp_types = config.get("mlp_layer_types")
    if mlp_types and list(mlp_types) != ["dense"] * dense + ["sparse"] * (num_layers - dense):
        raise UnsupportedModel(f"mlp_layer_types={mlp_types} in config.json: only the first first_k_dense_replace="
                               f"{dense} layers dense and the rest MoE is supported")
    interleaved = bool(config.get("indexer_rope_interleave", INDEXER_ROPE_INTERLEAVED[family]))
    return dict(dsa_index_heads=heads, dsa_index_head_dim=dim, dsa_index_topk=topk,
                dsa_indexer_rope_interleaved=interleaved)


# What the mapping needs of megatron-core's DSA beyond the variant itself (0.16.1 has an early DSA without them: its
# indexer always applies the Hadamard rotation, bf16 and fast_hadamard_transform only, and always rotates half-split).
NEEDED_FIELDS = ("dsa_indexer_rotate_activation", "dsa_indexer_rope_interleaved", "dsa_indexer_k_norm_epsilon",
                 "dsa_kernel_backend")


def megatron_has_dsa() -> bool:
    from megatron.core.transformer import TransformerConfig

    return set(NEEDED_FIELDS) <= {f.name for f in dataclasses.fields(TransformerConfig)}


def megatron_problem(spec) -> str | None:
    """Why this megatron-core cannot build ``spec``'s sparse attention, else None."""
    if not spec.dsa_index_topk or megatron_has_dsa():
        return None
    return (f"model_type={spec.family} needs DeepSeek sparse attention as megatron-core 0.19.2 builds it "
            f"(experimental_attention_variant='dsa' with {', '.join(NEEDED_FIELDS)}), and this is megatron-core "
            f"{version('megatron-core')}, whose DSA indexer always applies a bf16-only Hadamard rotation and "
            "half-split RoPE: install megatron-core 0.19.2 (tools/install.sh builds .venv312 with it)")


def kernel_backend() -> str:
    """megatron's fused DSA kernels where they can run (CUDA with their packages: 'tilelang'), else its PyTorch path
    ('none', the CPU's). The PyTorch path keeps every query's gathered top-k latent keys for the backward: fine for tests,
    hundreds of GiB at GLM-5's lengths (``plan`` assumes the fused kernels)."""
    if not torch.cuda.is_available():
        return "none"
    from megatron.core.utils import _validate_dsa_kernel_backend_dependencies

    try:
        _validate_dsa_kernel_backend_dependencies("tilelang")
    except ValueError:
        return "none"
    return "tilelang"


def transformer_config_fields(spec) -> dict:
    """``TransformerConfig`` fields of a DSA ``ModelSpec``: the indexer as transformers computes it, no indexer loss
    (frozen), megatron's fused kernels where they run (``kernel_backend``)."""
    return dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=spec.dsa_index_heads,
                dsa_indexer_head_dim=spec.dsa_index_head_dim, dsa_indexer_topk=spec.dsa_index_topk,
                dsa_indexer_loss_coeff=0.0, dsa_kernel_backend=kernel_backend(),
                dsa_indexer_rope_interleaved=spec.dsa_indexer_rope_interleaved, dsa_indexer_rotate_activation=False,
                dsa_indexer_scoring_relu=True, dsa_indexer_k_norm_epsilon=INDEXER_K_NORM_EPS,
                apply_rope_fusion=False)


class DuplicatedLinear(torch.nn.Module):
    """A linear layer held whole on every TP rank (TE's ``TELinear(parallel_mode="duplicated")`` for the local spec):
    the indexer's projections. Returns (output, None) as megatron's linears do."""

    def __init__(self, input_size, output_size, *, config, init_method, bias=False, skip_bias_add=False,
                 skip_weight_param_allocation=False, parallel_mode="duplicated", **unused):
        super().__init__()
        if bias or parallel_mode != "duplicated":
            raise ValueError("DuplicatedLinear: bias-free and duplicated only")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


def _local_dsa_attention(config):
    """megatron's DSA attention spec with the local spec's modules (its own function asserts TE)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
        AbsorbedMLASelfAttention, AbsorbedMLASelfAttentionSubmodules)
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexer, DSAIndexerSubmodules, DSAttention, DSAttentionSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    indexer = ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=DuplicatedLinear, linear_wk=DuplicatedLinear, k_norm=WrappedTorchNorm,
        linear_weights_proj=DuplicatedLinear))
    core = ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules(indexer=indexer))
    # the down projections column-parallel (gathered), as the local MLA spec builds them (mapping's "down" split)
    return ModuleSpec(module=AbsorbedMLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=AbsorbedMLASelfAttentionSubmodules(
                          linear_q_down_proj=ColumnParallelLinear, linear_q_up_proj=ColumnParallelLinear,
                          linear_kv_down_proj=ColumnParallelLinear, linear_kv_up_proj=ColumnParallelLinear,
                          core_attention=core, linear_proj=RowParallelLinear, q_layernorm=WrappedTorchNorm,
                          kv_layernorm=WrappedTorchNorm))


def dsa_spec(block, config, use_te: bool):
    """``block`` (an MLA decoder block spec) with megatron's DSA attention in every layer."""
    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_dsa_module_spec_for_backend)

        attention = get_dsa_module_spec_for_backend(config, backend=TESpecProvider())
    else:
        attention = _local_dsa_attention(config)

    def with_dsa(layer):
        return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention))

    return dataclasses.replace(block, layer_specs=[with_dsa(s) for s in block.layer_specs])


def freeze_indexer(model) -> None:
    """The indexers' weights stay as loaded (see the module docstring): not trained, not decayed."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

    for module in model.modules():
        if isinstance(module, DSAIndexer):
            for param in module.parameters():
                param.requires_grad_(False)
