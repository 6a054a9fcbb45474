"""A tiny Qwen3-MoE-shaped Megatron GPTModel (local spec) and helpers to compare parallel layouts.

Weights and reference gradients travel between layouts as torch_dist checkpoints: each layout loads the
world=1 weights through dist_checkpointing resharding, and loads the world=1 gradients the same way (a
sharded state dict whose tensors are the gradients), so every rank compares its own shards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 128
SEQ = 16
GLOBAL_BATCH = 4
MICRO_BATCH = 1


def build_model(
    dispatcher: str = "alltoall", seed: int = 0, per_sequence_loss: bool = False, routing_replay: bool = False,
    init: bool = True,
):
    """A 2-layer MoE GPTModel: 4 experts, top-2, GQA, q/k norm, RMSNorm, SwiGLU, no biases, RoPE.

    ``init=False`` builds it as the trainer does for weights it will load (``provider.skip_weight_init``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from gspo_megatron.model.provider import skip_weight_init

    tp = ps.get_tensor_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        moe_ffn_hidden_size=32,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        normalization="RMSNorm",
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        # MoE with TP>1 requires sequence parallelism in megatron-core.
        sequence_parallel=tp > 1,
        # The policy step normalises by sequences through megatron's per-token-loss mode.
        calculate_per_token_loss=per_sequence_loss,
        moe_enable_routing_replay=routing_replay,
        **({} if init else skip_weight_init()),
    )
    config.finalize_model_grads_func = finalize_model_grads
    if routing_replay:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        # RouterReplay keeps every router ever built in a class-level list: start it afresh per model.
        RouterReplay.clear_global_router_replay_instances()
    # Megatron initialises TP-split weights inside its RNG tracker's fork: re-seed it too, so a build is
    # a function of ``seed`` alone, not of how many models this process built before.
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    layer_spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, qk_layernorm=True)
    if config.context_parallel_size > 1:  # megatron's local attention has no CP; TE's needs CUDA
        from tests.cp_attention import AllGatherCPAttention

        layer_spec.submodules.self_attention.submodules.core_attention = AllGatherCPAttention
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    return model


def unwrap_layers(model):
    """The decoder layers of a (DDP-wrapped) GPTModel on this pipeline stage."""
    while hasattr(model, "module"):
        model = model.module
    return list(model.decoder.layers)


def wrap_ddp(model, distributed_optimizer: bool = False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
    )
    return DistributedDataParallel(model.config, ddp_config, model)


def global_batch(seed: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def local_batch() -> torch.Tensor:
    """This data-parallel rank's contiguous slice of the global batch."""
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = GLOBAL_BATCH // dp
    return global_batch()[rank * per_rank : (rank + 1) * per_rank]


def forward_backward(ddp_model, tokens: torch.Tensor, forward_only: bool = False):
    """Next-token cross-entropy (mean over tokens) through Megatron's schedule, micro batches of 1.

    Returns (mean loss over micro batches on the last stage or None, list of local logits per micro batch).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits_seen = []
    micro_batches = iter(tokens.split(MICRO_BATCH))
    positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, -1)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        output = model(inputs, positions, attention_mask=None)

        def loss_func(output_tensor):
            logits_seen.append(output_tensor.detach().clone())
            # [b, s, V/tp] -> [s, b, V/tp] for megatron's vocab-parallel CE.
            losses = vocab_parallel_cross_entropy(output_tensor.transpose(0, 1).contiguous(), labels.t())
            loss = losses.mean()
            # clone: the schedule divides its output by num_microbatches in place.
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    ddp_model.zero_grad_buffer()
    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=micro_batches,
        model=[ddp_model],
        num_microbatches=tokens.shape[0] // MICRO_BATCH,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=forward_only,
    )
    loss = None
    if ps.is_pipeline_last_stage():
        loss = torch.stack([r["loss"] for r in results]).mean()
    return loss, logits_seen


# ---- sharded state dicts carrying weights or gradients -------------------------------------------


def _sharded_tensors(sharded_state_dict):
    """ShardedTensors and ShardedTensorFactories (e.g. the GLU fc1 of experts), depth first."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    stack = [sharded_state_dict]
    while stack:
        node = stack.pop()
        items = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for value in items:
            if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
                yield value
            elif isinstance(value, (dict, list)):
                stack.append(value)


def tensors_only(sharded_state_dict):
    """Drop ShardedObjects (``_extra_state``), keeping the tensors (and tensor factories)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out = {}
    for key, value in sharded_state_dict.items():
        if isinstance(value, dict):
            out[key] = tensors_only(value)
        elif not isinstance(value, ShardedObject):
            out[key] = value
    return out


def grads_sharded_state_dict(model):
    """The model's sharded state dict with each parameter replaced by its (main) gradient."""
    grads = {p.data_ptr(): (p.main_grad if hasattr(p, "main_grad") else p.grad) for p in model.parameters()}
    sharded = tensors_only(model.sharded_state_dict())
    for sh in _sharded_tensors(sharded):
        sh.data = grads[sh.data.data_ptr()].detach().clone()
    return sharded


def empty_like_sharded(model):
    """A fresh sharded state dict (zeros) to load a checkpoint of the model's shape into."""
    sharded = tensors_only(model.sharded_state_dict())
    for sh in _sharded_tensors(sharded):
        sh.data = torch.zeros_like(sh.data)
    return sharded


def flat(sharded_or_plain, prefix=""):
    """Nested dict -> {dotted key: tensor} (ShardedTensors give their local data)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for key, value in sharded_or_plain.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}."))
        elif isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            out[name] = value.data
        elif torch.is_tensor(value):
            out[name] = value
    return out


def max_rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e|: one number per tensor, robust to entries near zero."""
    scale = expected.abs().max().clamp_min(1e-30)
    return ((actual - expected).abs().max() / scale).item()
