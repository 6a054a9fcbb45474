"""The Hugging Face <-> Megatron bridge: one mapping (``mapping``), three users.

Conversion (``convert``), SGLang weight sync (``rollout``) and the local engine all go through ``Bridge``:

``Bridge(spec).load_hf_weights(model, source)``
    HF -> Megatron in memory. ``source`` is an HF directory (safetensors, sharded or not), a
    ``{hf_name: tensor}`` dict or a ``hf_files.TensorSource``. Every rank reads only its own slices: its TP
    rows/columns, its EP ranks' experts, its pipeline stage's layers. The whole tensor set is checked first
    (``check_hf_tensors``): a missing, unexpected or mis-shaped tensor raises ``MappingError`` naming it.

``Bridge(spec).export_hf_weights(model, dtype=None)`` -> iterator of ``(hf_name, tensor)``
    Megatron -> HF, for weight sync and conversion. Call it on **every rank** of the model (it all-gathers
    over the TP, expert-TP and EP groups, so all ranks must iterate it to the end, in step). Each rank gets
    full, HF-shaped tensors (TP/EP gathered, vocabulary padding removed) on the parameters' device, in
    ``dtype`` if given (but the router's correction bias, which stays fp32: ``mapping.export_dtype``), else in
    each parameter's dtype (megatron's torch norms stay fp32 in a bf16 model: pass ``dtype`` to get the engine's
    dtype). Under pipeline parallelism each stage yields its own layers (global HF layer indices), the first
    stage the embedding, the last stage the final norm and ``lm_head`` (not for tied embeddings: their one copy
    comes from the first stage); data-parallel replicas yield the same tensors.
    Order: embedding, then layer by layer (within a MoE layer, experts in (local index, EP rank) order),
    then the head. Tensors may be views of live parameters: copy before modifying or keeping across an
    optimizer step. ``rollout.weight_sync.buckets`` groups the stream for bucketed transfer.

``Bridge(spec).export_to_sender(model, dtype=None)``
    The same tensors, in the same order, gathered onto one rank per pipeline stage only: the stage's *sender*,
    its first rank (tensor-, context-, data- and expert-parallel rank 0). The sender yields them; the ranks holding
    the other shards of its replica (its TP group; its expert replica's expert-TP and EP groups) take part in the
    gathers (``torch.distributed.gather`` to the first rank, not all-gathers) and yield nothing; every other rank
    (the other data-parallel replicas) returns at once, moving no data. ``is_stage_sender()`` says which rank this is.

``Bridge.hf_tensor_shapes()``: every HF tensor name of the model and its shape (layout independent).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator

import torch

from . import gpt_oss, mapping, sharding
from .errors import MappingError, listing
from .hf_config import ModelSpec
from .hf_files import TensorSource, open_hf_tensors
from .hidden_output import unwrap


@dataclass
class _Group:
    group: object
    size: int
    rank: int


@dataclass
class Placement:
    """One rule applied to one parameter of this rank's model."""

    rule: mapping.Rule
    megatron_name: str  # the parameter's name in this rank's model
    param: torch.Tensor  # a parameter, or the sigmoid router's expert_bias buffer
    hf_names: tuple[str, ...]  # global HF names of this rank's parameter
    layer: int | None = None  # global layer index
    local_expert: int | None = None
    num_local_experts: int = 0


def _groups():
    from megatron.core import parallel_state as ps

    return {
        "tp": _Group(ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(),
                     ps.get_tensor_model_parallel_rank()),
        "etp": _Group(ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size(),
                      ps.get_expert_tensor_parallel_rank()),
        "ep": _Group(ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_world_size(),
                     ps.get_expert_model_parallel_rank()),
    }


def _restacked(export):
    """An export whose per-expert tensors are stacked back where the family's checkpoints stack them
    (``mapping.STACKED_EXPERTS``: gpt-oss)."""

    @functools.wraps(export)
    def wrapper(self, model, dtype=None):
        stream = export(self, model, dtype)
        return gpt_oss.fuse_experts(stream, self.spec.num_experts) if self._stacked else stream

    return wrapper


class Bridge:
    def __init__(self, spec: ModelSpec, padded_vocab_size: int | None = None):
        self.spec = spec
        self.padded_vocab_size = padded_vocab_size or spec.padded_vocab_size()
        self._dims = spec.dims()
        self._heads_per_group = spec.num_attention_heads // spec.num_key_value_heads
        self._stacked = spec.family in mapping.STACKED_EXPERTS

    # ---- names and shapes -------------------------------------------------------------------------

    def hf_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return mapping.hf_tensor_shapes(self.spec)

    def check_hf_tensors(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Raise ``MappingError`` naming missing, unexpected and mis-shaped tensors (all of them at once)."""
        expected = self.hf_tensor_shapes()
        present = {k: tuple(v) for k, v in shapes.items()
                   if not mapping.is_ignored(k) and not mapping.is_carried(self.spec, k)}
        problems = []
        missing = set(expected) - set(present)
        unexpected = set(present) - set(expected)
        if missing:
            problems.append(listing("missing tensors", missing))
        if unexpected:
            problems.append(listing("unexpected tensors", unexpected))
        wrong = [f"{k} has shape {list(present[k])}, the config needs {list(expected[k])}"
                 for k in sorted(set(expected) & set(present)) if present[k] != expected[k]]
        if wrong:
            more = " ..." if len(wrong) > 8 else ""
            problems.append(f"shape mismatches ({len(wrong)}): " + "; ".join(wrong[:8]) + more)
        if problems:
            raise MappingError(f"the checkpoint does not match the {self.spec.family} config:\n  - "
                               + "\n  - ".join(problems))

    # ---- this rank's parameters -------------------------------------------------------------------

    def placements(self, model) -> list[Placement]:
        """Every parameter of this rank's model with its rule, in export order. Checks the table covers all."""
        gpt = unwrap(model)
        rules = mapping.rules_for(self.spec, getattr(gpt.config, "mla_down_proj_fusion", False))
        params = dict(gpt.named_parameters())
        # The sigmoid router's expert bias is a buffer (megatron updates it outside the optimizer, if at all).
        params.update((name, buffer) for name, buffer in gpt.named_buffers() if name.endswith(".router.expert_bias"))
        out: list[Placement] = []

        def names(rule: mapping.Rule, **where) -> list[str]:
            """The rule's parameter name under each layer spec: local, TE, grouped experts."""
            return [pattern.format(**where) for pattern in (rule.megatron, rule.te_name, rule.grouped) if pattern]

        def add(rule, megatron_where, hf_where, **extra):
            candidates = names(rule, **megatron_where)
            name = next((n for n in candidates if n in params), None)
            if name is None:
                if rule.tied_copy:  # only a last stage without the embedding holds the copy
                    return
                others = f" (nor {', '.join(candidates[1:])})" if len(candidates) > 1 else ""
                raise MappingError(f"the Megatron model has no parameter {candidates[0]}{others} "
                                   f"for HF {rule.hf[0].name.format(**hf_where)}")
            param = params[name]
            hf_names = tuple(self.spec.checkpoint_name(p.name.format(**hf_where)) for p in rule.hf)
            out.append(Placement(rule, name, param, hf_names, **extra))

        def model_rules(stage):
            for rule in rules:
                if rule.scope == mapping.MODEL and rule.stage == stage:
                    add(rule, {}, {})

        if gpt.pre_process:
            model_rules(mapping.FIRST)
        for local, layer in enumerate(gpt.decoder.layers):
            global_layer = layer.layer_number - 1
            is_moe = self.spec.is_moe_layer(global_layer)
            if is_moe != hasattr(layer.mlp, "router"):
                raise MappingError(f"decoder layer {global_layer}: the config says {'MoE' if is_moe else 'dense'}, "
                                   "the Megatron model disagrees")
            is_linear = self.spec.is_linear_attention_layer(global_layer)
            for rule in rules:
                if rule.scope == mapping.MODEL or (rule.scope == mapping.DENSE and is_moe) or (
                        rule.scope in (mapping.MOE, mapping.EXPERT) and not is_moe) or (
                        rule.scope == mapping.FULL_ATTENTION and is_linear) or (
                        rule.scope == mapping.LINEAR_ATTENTION and not is_linear):
                    continue
                if rule.scope != mapping.EXPERT:
                    add(rule, {"layer": local}, {"layer": global_layer}, layer=global_layer)
                    continue
                experts = list(layer.mlp.local_expert_indices)
                for local_expert, global_expert in enumerate(experts):
                    add(rule, {"layer": local, "expert": local_expert},
                        {"layer": global_layer, "expert": global_expert},
                        layer=global_layer, local_expert=local_expert, num_local_experts=len(experts))
        if gpt.post_process:
            model_rules(mapping.LAST)

        covered = {id(p.param) for p in out}
        unmapped = [name for name, param in params.items() if id(param) not in covered]
        if unmapped:
            title = f"Megatron parameters without a rule in the {self.spec.family} mapping"
            raise MappingError(listing(title, unmapped))
        return out

    def _hf_name(self, part: mapping.Part, layer: int, expert: int) -> str:
        return self.spec.checkpoint_name(part.name.format(layer=layer, expert=expert))

    def _tp(self, placement: Placement, groups) -> _Group:
        return groups["etp"] if placement.rule.scope == mapping.EXPERT else groups["tp"]

    # ---- HF -> Megatron ---------------------------------------------------------------------------

    @torch.no_grad()
    def load_hf_weights(self, model, source) -> None:
        """Fill this rank's parameters from HF tensors (a directory, a dict or a TensorSource)."""
        source: TensorSource = open_hf_tensors(source)
        self.check_hf_tensors(source.shapes())
        if self._stacked:
            source = gpt_oss.ExpertsView(source)  # the rules name each expert's tensors
        shapes = source.shapes()
        groups = _groups()
        for placement in self.placements(model):
            tp = self._tp(placement, groups)
            rule = placement.rule
            parts = []
            for name, part in zip(placement.hf_names, rule.hf):
                split = sharding.resolve(rule.split, placement.param)
                shape = shapes[name]
                if part.sections:  # one section of the tensor's rows, split over TP on its own
                    shape = (self._dims[part.dims[0]],) + tuple(shape[1:])
                index, pad = sharding.local_index(split, shape, tp.size, tp.rank, self.padded_vocab_size)
                if part.sections:
                    index = sharding.in_section(index, part.row_offset(self._dims), shape[0])
                parts.append(sharding.pad_rows(source.read(name, index), pad))
            local = sharding.join(rule.join, parts, self._heads_per_group, self.spec.head_dim, self._per_head(rule))
            if tuple(local.shape) != tuple(placement.param.shape):
                raise MappingError(f"{', '.join(placement.hf_names)} give a {list(local.shape)} shard for Megatron "
                                   f"{placement.megatron_name} of shape {list(placement.param.shape)}")
            placement.param.data.copy_(local)

    # ---- Megatron -> HF ---------------------------------------------------------------------------

    def _unjoin(self, placement: Placement, split: str, tp_size: int) -> list[torch.Tensor]:
        """This rank's parameter as its HF parts' shards."""
        shards = tp_size if sharding.split_dim(split) == 0 else 1
        rows = tuple(self._dims[part.dims[0]] // shards for part in placement.rule.hf)
        return sharding.unjoin(placement.rule.join, placement.param.detach(), self._heads_per_group,
                               self.spec.head_dim, rows, self._per_head(placement.rule))

    def _per_head(self, rule: mapping.Rule) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self._dims[d] for d in part.per_head) for part in rule.hf)

    @_restacked
    @torch.no_grad()
    def export_hf_weights(self, model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF tensors of this rank's pipeline stage; see the module docstring (call on every rank)."""
        groups = _groups()
        ep = groups["ep"]
        for placement in self.placements(model):
            rule = placement.rule
            if rule.tied_copy:
                continue
            tp = self._tp(placement, groups)
            split = sharding.resolve(rule.split, placement.param)
            parts = self._unjoin(placement, split, tp.size)
            parts = [sharding.gather(p, split, tp.group, tp.size) for p in parts]
            if rule.split == mapping.VOCAB:
                parts = [p[: self.spec.vocab_size] for p in parts]
            if rule.scope == mapping.EXPERT and ep.size > 1:
                for part, hf in zip(parts, rule.hf):
                    for ep_rank, tensor in enumerate(sharding.all_gather(part, ep.group, ep.size)):
                        expert = ep_rank * placement.num_local_experts + placement.local_expert
                        name = self._hf_name(hf, placement.layer, expert)
                        yield name, _cast(name, tensor, dtype)
                continue
            for name, part in _whole_tensors(placement.hf_names, parts):
                yield name, _cast(name, part, dtype)

    @_restacked
    @torch.no_grad()
    def export_to_sender(self, model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``export_hf_weights``'s tensors on this pipeline stage's sender only; see the module docstring."""
        groups = _groups()
        ep = groups["ep"]
        dense, experts = _sender_replica()
        if not (dense or experts):
            return
        for placement in self.placements(model):
            rule = placement.rule
            is_expert = rule.scope == mapping.EXPERT
            if rule.tied_copy or not (experts if is_expert else dense):
                continue
            tp = self._tp(placement, groups)
            split = sharding.resolve(rule.split, placement.param)
            parts = self._unjoin(placement, split, tp.size)
            parts = [sharding.gather_to_first(p, split, tp.group, tp.size) for p in parts]
            if tp.rank != 0:
                continue  # this rank's shards are on their way to its TP group's first rank
            if rule.split == mapping.VOCAB:
                parts = [p[: self.spec.vocab_size] for p in parts]
            if is_expert and ep.size > 1:
                for part, hf in zip(parts, rule.hf):
                    gathered = sharding.gather_list_to_first(part, ep.group, ep.size)
                    for ep_rank, tensor in enumerate(gathered or []):
                        expert = ep_rank * placement.num_local_experts + placement.local_expert
                        name = self._hf_name(hf, placement.layer, expert)
                        yield name, _cast(name, tensor, dtype)
                continue
            for name, part in _whole_tensors(placement.hf_names, parts):
                yield name, _cast(name, part, dtype)

    def export_names(self, model) -> list[str]:
        """The HF names ``export_hf_weights`` yields on this rank, without moving any data."""
        return list(self.export_dtypes(model))

    def export_dtypes(self, model) -> dict[str, torch.dtype]:
        """The HF names ``export_hf_weights(model)`` yields on this rank, in order, each with the dtype it yields
        (its parameter's: the router's bias and torch norms may be fp32 in a bf16 model), without moving any data."""
        from megatron.core import parallel_state as ps

        ep_size = ps.get_expert_model_parallel_world_size()
        dtypes = {}
        for placement in self.placements(model):
            rule = placement.rule
            if rule.tied_copy:
                continue
            if rule.scope == mapping.EXPERT and ep_size > 1:
                experts = [r * placement.num_local_experts + placement.local_expert for r in range(ep_size)]
                names = [self._hf_name(hf, placement.layer, e) for hf in rule.hf for e in experts]
            else:
                names = placement.hf_names
            dtypes.update((gpt_oss.stacked_name(name) if self._stacked else name, placement.param.dtype)
                          for name in names)
        return dtypes


def _sender_replica() -> tuple[bool, bool]:
    """Whether this rank holds a shard the stage's sender needs: (dense: in the sender's TP group, i.e. data- and
    context-parallel rank 0; experts: in the sender's expert replica, i.e. expert-data-parallel rank 0)."""
    from megatron.core import parallel_state as ps

    dense = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    return dense, ps.get_expert_data_parallel_rank() == 0


def is_stage_sender() -> bool:
    """This rank is its pipeline stage's sender (``export_to_sender`` yields there): tensor-, context-, data-,
    expert- and expert-tensor-parallel rank 0."""
    from megatron.core import parallel_state as ps

    dense, experts = _sender_replica()
    return (dense and experts and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_expert_model_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0)


def _whole_tensors(names: tuple[str, ...], parts: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) per HF tensor: the row sections of one tensor (``mapping.Part.sections``, consecutive parts
    of one name) stacked again."""
    start = 0
    while start < len(names):
        end = start + 1
        while end < len(names) and names[end] == names[start]:
            end += 1
        yield names[start], parts[start] if end == start + 1 else torch.cat(parts[start:end])
        start = end


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(mapping.export_dtype(name, tensor, dtype))
