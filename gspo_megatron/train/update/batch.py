"""A micro batch put where the model needs it (Megatron-LM's ``get_batch``): on the device, with position ids,
split over context-parallel ranks, and with ``pack`` its sequences as one packed row (``parallel.packing``:
TransformerEngine's THD attention, or a block-diagonal causal mask with megatron's local attention). The model's
per-token results are unpacked to the padded [b, S] layout (``padded``) before the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gspo_megatron import environment
from gspo_megatron.parallel import context, packing


def megatron_groups():
    """(this rank's tensor-parallel group, its context-parallel group, megatron's ``parallel_state``)."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group(), ps


@dataclass(frozen=True)
class Packing:
    """How one schedule's micro batches are packed (``parallel.packing``): through TransformerEngine's THD
    attention (``thd``) or a block-diagonal mask, each row ``length`` tokens (pipeline parallelism needs one
    shape for every micro batch) or, with None, its own sequences' tokens rounded up to ``multiple``. Under
    context parallelism each sequence's segment is padded to ``segment_multiple`` = 2 * cp (its 2 * cp chunks)."""

    thd: bool
    multiple: int
    sequence_parallel: bool
    length: int | None = None
    segment_multiple: int = 1

    def row_length(self, seq_lengths: torch.Tensor) -> int:
        return self.length or packing.packed_length(seq_lengths, self.multiple, self.segment_multiple)


def _unwrapped(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def schedule_packing(model, micro_batches: list[dict], pack: bool) -> Packing | None:
    """The ``Packing`` of a schedule over ``micro_batches`` (each with ``seq_lengths``), or None without ``pack``."""
    if not pack:
        return None
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    _, _, ps = megatron_groups()
    if any("seq_lengths" not in mb for mb in micro_batches):
        raise ValueError("packed micro batches need seq_lengths [b] (prompt + response tokens of each row)")
    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    sp = bool(_unwrapped(model).config.sequence_parallel) and tp > 1
    # The gated-DeltaNet hybrids' linear-attention layers have no core attention; they take either packing
    # (model.gated_deltanet), so a stage of only those packs as the local attention does.
    cores = [layer.self_attention.core_attention for layer in _unwrapped(model).decoder.layers
             if hasattr(layer.self_attention, "core_attention")]
    local = all(isinstance(core, DotProductAttention) for core in cores)
    if local and cp > 1:
        raise NotImplementedError("packed rows under context parallelism need THD attention (TransformerEngine's): "
                                  "megatron's local attention has neither")
    # A row splits into cp shares of whole chunks of every segment (the trailing padding one too), each share
    # into tp under sequence parallelism.
    segment_multiple = 2 * cp if cp > 1 else 1
    multiple = context.sequence_multiple(tp, cp, sp)
    length = None
    if ps.get_pipeline_model_parallel_world_size() > 1:  # stages exchange [length / (cp * tp), 1, H] tensors
        length = max(packing.packed_length(mb["seq_lengths"], multiple, segment_multiple) for mb in micro_batches)
    return Packing(thd=not local, multiple=multiple, sequence_parallel=sp, length=length,
                   segment_multiple=segment_multiple)


def batch_for_model(batch: dict, packed: Packing | None = None) -> dict:
    """This rank's share of a micro batch, where the model needs it (Megatron-LM's ``get_batch``): on
    ``environment.device()``, with ``position_ids``, split over the context-parallel group; with ``packed``, its
    sequences as one row with their packing metadata (THD ``packed_seq_params`` or a block-diagonal
    ``attention_mask``) and the ``unpack_index`` back to the padded layout."""
    _, cp_group, _ = megatron_groups()
    batch = environment.to_device(batch, environment.device())
    if packed is not None:
        batch = packing.pack(batch, packed.row_length(batch["seq_lengths"]), packed.segment_multiple)
        if packed.thd:
            batch["packed_seq_params"] = packing.packed_seq_params(batch["cu_seqlens"], batch["max_seqlen"],
                                                                   batch.get("cu_seqlens_unpadded"))
        else:
            batch["attention_mask"] = packing.block_causal_mask(batch["cu_seqlens"], batch["input_ids"].shape[1])
        batch["sequence_parallel"] = packed.sequence_parallel
        return context.split_packed(batch, cp_group)  # under CP: every segment's chunks r and 2*cp-1-r
    ids = batch["input_ids"]
    batch["position_ids"] = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    return context.split_batch(batch, cp_group)


def padded(batch: dict, values: torch.Tensor | None) -> torch.Tensor | None:
    """Per-token results of the model's rows -> the micro batch's padded [b, S] layout (packed rows: unpacked)."""
    if values is None or "unpack_index" not in batch:
        return values
    return packing.unpack(values, batch["unpack_index"])


def computed_positions(micro_batches: list[dict], packed: Packing | None) -> tuple[int, int]:
    """(tokens of the micro batches' sequences, token positions the model computes for them): padded rows cost
    their width each, packed rows their length. Without ``seq_lengths`` a padded row counts as all real."""
    real = computed = 0
    for mb in micro_batches:
        b, width = mb["input_ids"].shape[:2]
        lengths = mb.get("seq_lengths")
        real += int(lengths.sum()) if lengths is not None else b * width
        computed += packed.row_length(lengths) if packed is not None else b * width
    return real, computed
