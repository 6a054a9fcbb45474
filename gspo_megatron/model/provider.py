"""The Megatron policy for a ``ModelSpec``: its ``TransformerConfig`` and ``GPTModel``.

``build_gpt_model(spec, layout)`` builds this rank's part of the model after Megatron's process groups are
up (``parallel.groups.init_model_parallel(layout)``). What each family means in megatron-core terms:

- RMSNorm everywhere, gated SiLU MLPs without biases, RoPE (theta and Llama-3 scaling from the config).
- Grouped-query attention with ``kv_channels = head_dim`` (which may differ from hidden / heads);
  Qwen3 adds ``qk_layernorm``, Qwen2 ``add_qkv_bias``.
- Qwen3-MoE routing: softmax -> top-k -> renormalise (``norm_topk_prob``) is megatron's softmax over the
  top-k logits (``moe_router_pre_softmax=False``); without renormalisation it is softmax -> top-k
  (``moe_router_pre_softmax=True``). Which layers are MoE (``mlp_only_layers`` / ``decoder_sparse_step``)
  is ``moe_layer_freq`` as a 0/1 list, through megatron's decoder block spec.
- DeepSeek-V3 / GLM-4.5 routing (``spec.moe_router == "sigmoid"``): megatron's sigmoid router with
  ``moe_router_enable_expert_bias`` (HF's ``e_score_correction_bias`` is the router's ``expert_bias`` buffer:
  added to the scores to choose experts, not to the weights), ``moe_router_num_groups`` / ``moe_router_group_topk``
  (n_group / topk_group), ``moe_router_topk_scaling_factor`` (routed_scaling_factor), shared experts
  (``moe_shared_expert_intermediate_size``, no gate). The bias is frozen unless ``update_expert_bias``
  (``freeze_expert_bias``). GLM-4.5's partial rotary is ``rotary_percent``.
- DeepSeek-V3's multi-latent attention (``spec.attention == "mla"``): megatron's ``MLATransformerConfig`` (q LoRA
  rank or none, kv LoRA rank, nope / rope / v head dims, ``qk_layernorm`` for the two latent norms, YaRN as
  ``rope_type="yarn"`` whose mscale_all_dim also sets the softmax scale); the attention builds its own RoPE.
  ``mla_down_proj_fusion`` (megatron-core >= 0.19, q LoRA): the q and kv down projections as one GEMM.
- MiniMax-M2's q/k norm over the whole projection (``spec.qk_norm_whole_projection``): megatron's q/k norm slots hold
  ``minimax_m2.WholeProjectionRMSNorm`` (its squares summed over the TP group), under both specs.
- Experts: with TransformerEngine, megatron's ``TEGroupedMLP`` (``moe_grouped_gemm=True``): each layer's local
  experts run as one grouped GEMM per projection. Without TE, a ``SequentialMLP`` (a Python loop over the local
  experts, with a host sync for the split sizes). The mapping names both layouts, and their dist-checkpoint keys
  are the same, so a checkpoint written by either loads into the other.
- The vocabulary is padded to ``ModelSpec.padded_vocab_size()`` rows (the bridge zero-fills the padding).

Layer specs: megatron-core's local spec on CPU, TransformerEngine's where ``transformer_engine`` imports.
With the local spec, a MoE layer's pre-MLP norm is saved under its own name, as TE's spec does (megatron's
local spec would save it as the dense ``mlp.linear_fc1.layer_norm_weight``), so a checkpoint written on CPU
loads into a TE model.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F

from gspo_megatron import environment
from gspo_megatron.parallel.groups import Layout

from .hf_config import ModelSpec
from .layout_check import check_layout


def _leave_as_is(tensor):
    """An init method that leaves the tensor alone (some megatron modules assign what it returns)."""
    return tensor


def skip_weight_init() -> dict:
    """``TransformerConfig`` fields for a model whose weights will be loaded, not initialised.

    Not ``perform_initialization=False``: megatron-core (0.16 and earlier; Megatron-LM PR #4084 moved it) sets a
    weight's tensor-parallel attributes (``tensor_model_parallel``, ``partition_dim``) only inside its
    initialisation functions, and without them the TP-aware gradient norm counts every split weight as a TP
    duplicate (rank 0's shard only): clipping and the logged norm go wrong under TP. So the initialisation path
    runs, with init methods that write nothing.
    """
    return dict(perform_initialization=True, init_method=_leave_as_is, output_layer_init_method=_leave_as_is,
                embedding_init_method=_leave_as_is)


def transformer_config(spec: ModelSpec, layout: Layout, dtype: torch.dtype = torch.float32, init: bool = False,
                       grouped_gemm: bool = False, mla_down_proj_fusion: bool = False, **overrides):
    """Megatron's ``TransformerConfig`` for ``spec`` under ``layout``. ``overrides`` win over the defaults.

    Defaults suit RL training and scoring: no dropout, per-token-loss mode (``train.update.loss`` needs it),
    no router auxiliary loss, the alltoall token dispatcher, no weight initialisation unless ``init`` (the
    weights come from a checkpoint; ``skip_weight_init``). ``grouped_gemm``: the experts as one grouped GEMM
    (``build_gpt_model`` decides it and checks that megatron can build it). ``mla_down_proj_fusion``: megatron's
    fused MLA down projection (refused, naming why, where ``mla.down_proj_fusion_problem`` finds a reason).
    """
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    tp = layout.tensor
    moe = {}
    if spec.is_moe:
        moe = dict(
            num_moe_experts=spec.num_experts,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_topk=spec.moe_topk,
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not spec.norm_topk_prob,
            moe_layer_freq=[int(m) for m in spec.moe_layers],
            moe_grouped_gemm=grouped_gemm,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
        )
        if spec.moe_router == "sigmoid":
            grouped = spec.moe_router_groups > 1
            moe.update(
                moe_router_score_function="sigmoid",
                moe_router_pre_softmax=False,
                moe_router_enable_expert_bias=True,
                moe_router_num_groups=spec.moe_router_groups if grouped else None,
                moe_router_group_topk=spec.moe_router_group_topk if grouped else None,
                moe_router_topk_scaling_factor=spec.moe_scaling_factor,
                moe_shared_expert_intermediate_size=spec.moe_shared_ffn_hidden_size or None,
            )
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        gated_linear_unit=True,
        activation_func=F.silu,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        **({} if init else skip_weight_init()),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=layout.pipeline,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        context_parallel_size=layout.context,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.expert_tensor or tp,
        sequence_parallel=layout.sequence_parallel and tp > 1,
        calculate_per_token_loss=True,
        **moe,
    )
    if spec.linear_attention_layers:
        from .gated_deltanet import transformer_config_fields

        kwargs.update(transformer_config_fields(spec))
    if spec.moe_shared_expert_gate:
        kwargs.update(moe_shared_expert_intermediate_size=spec.moe_shared_ffn_hidden_size, moe_shared_expert_gate=True)
    config_class = TransformerConfig
    if spec.attention == "mla":
        config_class = MLATransformerConfig
        kwargs.update(_mla_fields(spec))
    if spec.dsa_index_topk:
        from .dsa import transformer_config_fields as dsa_config_fields

        kwargs.update(dsa_config_fields(spec))
    if spec.attention_sinks:
        from .gpt_oss import megatron_fields

        kwargs.update(megatron_fields(spec))
    if mla_down_proj_fusion:
        from .mla import down_proj_fusion_problem

        problem = down_proj_fusion_problem(spec)
        if problem:
            raise ValueError(problem)
        kwargs["mla_down_proj_fusion"] = True
    kwargs.update(overrides)
    config = config_class(**kwargs)
    config.finalize_model_grads_func = finalize_model_grads
    if spec.yarn_factor is not None and spec.attention == "gqa":
        # GPTModel's YaRN (position_embedding_type "yarn") and its attention read these attributes, not fields
        config.yarn_rotary_scaling_factor = spec.yarn_factor
        config.yarn_original_max_position_embeddings = spec.yarn_original_max_position_embeddings
        config.yarn_beta_fast, config.yarn_beta_slow = spec.yarn_beta_fast, spec.yarn_beta_slow
        config.yarn_mscale, config.yarn_mscale_all_dim = spec.yarn_mscale, spec.yarn_mscale_all_dim
        config.yarn_correction_range_round_to_int = spec.yarn_truncate
    return config


def _mla_fields(spec: ModelSpec) -> dict:
    yarn = spec.yarn_factor is not None
    return dict(
        multi_latent_attention=True,
        q_lora_rank=spec.q_lora_rank or None,
        kv_lora_rank=spec.kv_lora_rank,
        qk_head_dim=spec.head_dim - spec.qk_rope_head_dim,
        qk_pos_emb_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        qk_layernorm=True,  # the q and kv latent RMSNorms
        rope_type="yarn" if yarn else "rope",
        rotary_base=spec.rope_theta,
        rotary_scaling_factor=spec.yarn_factor if yarn else 1.0,
        original_max_position_embeddings=spec.yarn_original_max_position_embeddings or spec.max_position_embeddings,
        beta_fast=spec.yarn_beta_fast,
        beta_slow=spec.yarn_beta_slow,
        mscale=spec.yarn_mscale,
        mscale_all_dim=spec.yarn_mscale_all_dim,
    )


def freeze_expert_bias(model) -> None:
    """Keep the sigmoid routers' ``expert_bias`` as loaded: RL's default.

    megatron-core's aux-loss-free balancing counts each router's tokens in every forward with grad and, in
    ``finalize_model_grads``, moves the bias by ``moe_router_bias_update_rate`` towards balance (both gated by
    ``moe_router_enable_expert_bias``). In RL that moves the routing the rollout engine was given away from the
    trainer's with no loss behind it, so by default neither happens: the routers still route with the bias (they
    registered it at build), but stop counting, and ``finalize_model_grads`` (which reads the model config's flag)
    skips the update. ``update_expert_bias=True`` keeps megatron's behaviour; weight sync carries the bias either way.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    for module in model.modules():
        if isinstance(module, TopKRouter) and module.expert_bias is not None:
            module.enable_expert_bias = False
            module.config.moe_router_enable_expert_bias = False


def reduce_experts_over_expert_data_parallel(model) -> None:
    """Tag every expert parameter ``allreduce=False`` where expert-TP differs from TP, so that DDP sums its gradient
    over the expert-data-parallel group and the optimizer's expert half steps it.

    megatron-core 0.16.1 tags expert linears so only under expert parallelism (EP > 1): under TP2 with expert-TP 1
    on one expert rank, each TP rank holds every expert whole and routes its own sequence shard through them, but
    DDP reduced their gradients as dense ones, over the data-parallel group (one rank): each rank stepped with its
    shard's gradient alone (up to 4e-2 off world 1 after one step, the two ranks' experts diverging), and the
    gradient norm added the two partial gradients' squares. 0.19.2 tags them when EP > 1 or expert-TP != TP
    (``use_expert_pgs`` in tensor_parallel/layers.py): the same rule, a no-op there."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer) and (module.config.expert_model_parallel_size > 1 or
                                             module.config.expert_tensor_parallel_size
                                             != module.config.tensor_model_parallel_size):
            for param in module.experts.parameters():
                param.allreduce = False


def _builds(spec):
    """The class a megatron layer spec builds: a ``ModuleSpec``'s module (megatron-core 0.16), or the function of
    a builder ``partial`` (0.19 describes MoE layers and experts that way)."""
    return getattr(spec, "module", None) or getattr(spec, "func", None)


def _submodules(spec):
    return getattr(spec, "submodules", None) or getattr(spec, "keywords", {}).get("submodules")


def _moe_norm_keeps_its_name(layer_spec):
    """Drop the local spec's ``pre_mlp_layernorm. -> mlp.linear_fc1.layer_norm_`` key map on MoE layers."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    submodules = layer_spec.submodules
    if _builds(submodules.mlp) is not MoELayer:
        return layer_spec
    keys_map = {k: v for k, v in submodules.sharded_state_dict_keys_map.items() if k != "pre_mlp_layernorm."}
    submodules = dataclasses.replace(submodules, sharded_state_dict_keys_map=keys_map)
    return dataclasses.replace(layer_spec, submodules=submodules)


def decoder_block_spec(config, use_te: bool):
    """This pipeline stage's layer specs (dense or MoE per ``moe_layer_freq``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec_config = config
    if config.experimental_attention_variant in ("gated_delta_net", "dsa"):
        # megatron-core 0.19 refuses the variant here (its own hybrid spec is TE-only): the block is built with
        # full attention everywhere, and gated_deltanet.hybrid_spec (dsa.dsa_spec) puts the variant into its layers
        spec_config = copy.copy(config)
        spec_config.experimental_attention_variant = None
    block = get_gpt_decoder_block_spec(spec_config, use_transformer_engine=use_te, normalization="RMSNorm")
    if not use_te:
        block = dataclasses.replace(block, layer_specs=[_moe_norm_keeps_its_name(s) for s in block.layer_specs])
    if config.experimental_attention_variant == "dsa":
        from .dsa import dsa_spec

        block = dsa_spec(block, config, use_te)
    elif config.multi_latent_attention:
        from .mla import mla_spec

        block = mla_spec(block, local=not use_te, q_lora=config.q_lora_rank is not None,
                         down_proj_fusion=getattr(config, "mla_down_proj_fusion", False))
    if config.experimental_attention_variant == "gated_delta_net" or config.layernorm_zero_centered_gamma:
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        from .gated_deltanet import hybrid_spec

        block = hybrid_spec(block, config, use_te, first_layer=get_transformer_layer_offset(config))
    if config.moe_grouped_gemm:
        _check_grouped_experts(block)
    return block


def experts_modules(block) -> set[str]:
    """The class names of the expert modules the MoE layers of ``block`` will build."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    mlps = [s.submodules.mlp for s in block.layer_specs]
    return {_builds(_submodules(m).experts).__name__ for m in mlps if _builds(m) is MoELayer}


def _check_grouped_experts(block) -> None:
    """Grouped experts must be TEGroupedMLP. Without TE >= 1.9 megatron builds something else: the legacy
    GroupedMLP (0.16: one [H, E*F] weight, the ``grouped_gemm`` package, bf16 only, which the mapping does not
    name) or a SequentialMLP (0.19): refuse either, rather than run ungrouped experts the config asked to group."""
    built = experts_modules(block) - {"TEGroupedMLP"}
    if built:
        raise ValueError(
            f"grouped_gemm=True needs TransformerEngine >= 1.9 (megatron's TEGroupedMLP), but megatron-core would "
            f"build {', '.join(sorted(built))}: install the gpu extra, or set model.grouped_gemm=false"
        )


def _check_groups_match(layout: Layout) -> None:
    from megatron.core import parallel_state as ps

    actual = dict(tensor=ps.get_tensor_model_parallel_world_size(),
                  pipeline=ps.get_pipeline_model_parallel_world_size(),
                  expert=ps.get_expert_model_parallel_world_size(), context=ps.get_context_parallel_world_size())
    wanted = dict(tensor=layout.tensor, pipeline=layout.pipeline, expert=layout.expert, context=layout.context)
    if actual != wanted:
        raise ValueError(f"the model's layout {wanted} differs from Megatron's process groups {actual}: "
                         "call parallel.groups.init_model_parallel(layout) with the same layout first")


def megatron_patches(use_te: bool, cuda: bool, gated_deltanet: bool = False) -> list:
    """The named patches (modules with ``apply()``) a model build needs: ``megatron_cpu`` without CUDA, and
    ``megatron_no_te`` whenever TransformerEngine is not used, on a GPU too (megatron-core 0.16.1's router reads an
    undefined ``te_general_gemm`` without TE); for a gated-DeltaNet hybrid without CUDA, ``megatron_gated_deltanet``
    (the DeltaNet's torch kernels in place of fla's Triton ones)."""
    from patches import megatron_cpu, megatron_gated_deltanet, megatron_no_te

    return (([] if cuda else [megatron_cpu]) + ([] if use_te else [megatron_no_te])
            + ([megatron_gated_deltanet] if gated_deltanet and not cuda else []))


def build_gpt_model(spec: ModelSpec, layout: Layout = Layout(), dtype: torch.dtype = torch.float32,
                    padded_vocab_size: int | None = None, use_te: bool | None = None, init: bool = False,
                    grouped_gemm: bool | None = None, update_expert_bias: bool = False,
                    mla_down_proj_fusion: bool = False, **config_overrides):
    """This rank's ``GPTModel`` for ``spec`` under ``layout`` (Megatron's groups must already match it).

    ``padded_vocab_size`` defaults to ``spec.padded_vocab_size()``; a checkpoint records the value it was
    converted with. ``use_te`` defaults to whether TransformerEngine imports; ``grouped_gemm`` (MoE experts as
    TEGroupedMLP) to ``use_te``. ``grouped_gemm=True`` where megatron cannot build TEGroupedMLP is an error.
    ``update_expert_bias``: let megatron update sigmoid routers' expert bias from load statistics (default: frozen,
    ``freeze_expert_bias``). ``mla_down_proj_fusion``: MLA's q and kv down projections as megatron's one fused
    ``linear_qkv_down_proj`` (megatron-core >= 0.19, q LoRA only; ``transformer_config``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    import torch.distributed as dist

    vocab = padded_vocab_size or spec.padded_vocab_size()
    use_te = environment.transformer_engine_available() if use_te is None else use_te
    if not use_te:
        environment.note_fallbacks()
    for patch in megatron_patches(use_te, cuda=torch.cuda.is_available(),
                                  gated_deltanet=bool(spec.linear_attention_layers)):
        patch.apply()
    check_layout(spec, layout, dist.get_world_size(), padded_vocab_size=vocab, transformer_engine=use_te)
    _check_groups_match(layout)
    grouped_gemm = use_te if grouped_gemm is None else grouped_gemm
    config = transformer_config(spec, layout, dtype=dtype, init=init, grouped_gemm=grouped_gemm and spec.is_moe,
                                mla_down_proj_fusion=mla_down_proj_fusion, **config_overrides)
    block = decoder_block_spec(config, use_te)
    if spec.qk_norm_whole_projection:
        from .minimax_m2 import whole_projection_norm_spec

        block = whole_projection_norm_spec(block)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=vocab,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="yarn" if spec.yarn_factor is not None and spec.attention == "gqa" else "rope",
        rotary_percent=spec.rotary_percent,
        rotary_base=spec.rope_theta,
        rope_scaling=spec.rope_scaling_factor is not None,
        rope_scaling_factor=spec.rope_scaling_factor or 8.0,
    )
    # megatron creates the MoE routers' weights on the CPU ("TODO: Add support for GPU initialization") and moves
    # them in their first forward, after the optimizer copied them: every parameter goes to the device now.
    model.to(environment.device())
    if not update_expert_bias:
        freeze_expert_bias(model)
    reduce_experts_over_expert_data_parallel(model)
    if spec.linear_bias:
        from .gpt_oss import fix_megatron_parameters

        fix_megatron_parameters(model)
    if spec.dsa_index_topk:
        from .dsa import freeze_indexer

        freeze_indexer(model)
    if spec.qk_norm_whole_projection:
        from .minimax_m2 import fix_megatron_parameters as fix_whole_projection_norm

        fix_whole_projection_norm(model)
    # The real vocabulary: log-probs (hidden_output / the fused op) must leave the padding rows out.
    model.unpadded_vocab_size = spec.vocab_size
    return model
