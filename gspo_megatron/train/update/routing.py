"""Routing record and replay through megatron-core's RouterReplay (the model needs moe_enable_routing_replay=True).

Two batch keys: ``old_routing`` [b, L_local, s_local, k], the old-policy pass's record, which the update replays
(GRPO + Routing Replay, ``update_step(replay_old_routing=True)``) or compares with the experts it chooses (expert
volatility); ``rollout_routing`` [b, S, L, k], the engine's experts of every layer replayed by both passes (rollout
routing replay, R3). Records are kept per sequence, so the update may regroup rows into other micro
batches; packed rows are unpacked (gathered over TP under sequence parallelism) and packed again for replay.
"""

from __future__ import annotations

import torch

from gspo_megatron.parallel import packing
from gspo_megatron.train.update.batch import megatron_groups


def router_replay():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    return RouterReplay, RouterReplayAction


def recorded_routing(batch_size: int) -> torch.Tensor:
    """This rank's routers' recorded top-k after one forward: [b, L_local, s_local, k] int16.

    Each router saw its tokens flattened s-major ([s_local * b, k]); regrouping them per sequence lets the
    update pass split the rollout into different micro batches than the old-policy pass did. int16 (expert ids
    < 32768) keeps a rollout's routing at a quarter of int64's memory; ``replay`` widens it again.
    """
    RouterReplay, _ = router_replay()
    layers = [t.detach().reshape(-1, batch_size, t.shape[-1]).transpose(0, 1) for t in RouterReplay.get_recorded_data()
              if t is not None]
    if not layers:  # a pipeline stage without MoE layers
        return torch.zeros(batch_size, 0, 0, 0, dtype=torch.int16)
    return torch.stack(layers, dim=1).to(torch.int16)


def sequence_routing(batch: dict) -> torch.Tensor:
    """This rank's routing record of one forward, per sequence of the micro batch. Padded rows: as recorded,
    [b, L_local, s_local, k]. A packed row: [b, L_local, S, k] in the padded layout, gathered over the TP group
    under sequence parallelism (every TP rank then holds the whole record)."""
    record = recorded_routing(batch["input_ids"].shape[0])
    if "unpack_index" not in batch:
        return record
    index = batch["unpack_index"]
    if record.shape[1] == 0:  # a pipeline stage without MoE layers
        return torch.zeros(index.shape[0], 0, 0, 0, dtype=record.dtype, device=record.device)
    tp_group, _, ps = megatron_groups()
    tp = ps.get_tensor_model_parallel_world_size()
    if batch["sequence_parallel"]:  # this rank's routers saw 1/tp of the row
        parts = [torch.empty(record.shape, dtype=torch.int32, device=record.device) for _ in range(tp)]
        torch.distributed.all_gather(parts, record.to(torch.int32).contiguous(), group=tp_group)
        record = torch.cat(parts, dim=2).to(record.dtype)
    return packing.unpack(record.transpose(1, 2), index).transpose(1, 2)


def packed_routing(batch: dict, routing: torch.Tensor) -> torch.Tensor:
    """The inverse of ``sequence_routing`` on a packed row: [b, L, S, k] -> this rank's [1, L, s_local, k]."""
    if "unpack_index" not in batch or routing.shape[1] == 0:
        return routing
    length = batch["input_ids"].shape[1]
    # Padding has no record: any k distinct experts (a repeated expert would miscount the dispatch).
    distinct = torch.arange(routing.shape[-1], dtype=routing.dtype, device=routing.device)
    row = packing.pack_rows(routing.transpose(1, 2), batch["unpack_index"], length, fill=distinct).transpose(1, 2)
    if batch["sequence_parallel"]:
        _, _, ps = megatron_groups()
        s_local = length // ps.get_tensor_model_parallel_world_size()
        rank = ps.get_tensor_model_parallel_rank()
        row = row[:, :, rank * s_local:(rank + 1) * s_local]
    return row


def set_routing_action(action_name: str) -> None:
    RouterReplay, Action = router_replay()
    RouterReplay.set_global_router_replay_action(getattr(Action, action_name))


def replay(routing: torch.Tensor) -> None:
    """Make this rank's routers use ``routing`` [b, L_local, s_local, k] in the next forward."""
    RouterReplay, _ = router_replay()
    per_layer = [routing[:, layer].transpose(0, 1).reshape(-1, routing.shape[-1]).long()
                 for layer in range(routing.shape[1])]
    RouterReplay.set_replay_data(per_layer)
    set_routing_action("REPLAY_FORWARD")


def _router_layers(model) -> tuple[list[int], bool]:
    """The global (0-based) layer index of each of this rank's routers, in RouterReplay's order (construction
    order: layer order), so a pipeline stage picks its layers out of a whole model's routes; and whether they see
    a sequence-parallel share of the tokens."""
    found = getattr(model, "_gspo_router_layers", None)
    if found is None:
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        found = ([r.layer_number - 1 for r in routers], bool(routers) and routers[0].config.sequence_parallel)
        model._gspo_router_layers = found
    return found


def rank_routing(model, routing: torch.Tensor) -> torch.Tensor:
    """Routes of every layer of the whole sequence (rollout routing replay) -> what this rank's routers see.

    ``routing`` [b, s_cp, L, k] is the micro batch's ``rollout_routing`` after the context-parallel split
    (``batch_for_model``); the result [b, L_local, s_local, k] is what ``recorded_routing`` would have recorded:
    this pipeline stage's MoE layers, and under sequence parallelism this TP rank's contiguous 1/tp of the tokens.
    """
    layers, sequence_parallel = _router_layers(model)
    if layers and max(layers) >= routing.shape[2]:
        raise ValueError(f"rollout routing has {routing.shape[2]} layers but the model routes at layer "
                         f"{max(layers)}: the engine serves a different model than the trainer's")
    local = routing[:, :, layers]  # [b, s_cp, L_local, k]
    _, _, ps = megatron_groups()
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1 and sequence_parallel:
        s_local = local.shape[1] // tp
        rank = ps.get_tensor_model_parallel_rank()
        local = local[:, rank * s_local:(rank + 1) * s_local]
    return local.transpose(1, 2)


def end_routing_replay() -> None:
    RouterReplay, _ = router_replay()
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_indices()


def router_token_mask(loss_mask: torch.Tensor, s_local: int) -> torch.Tensor:
    """The tokens of this rank's routers [b, s_local] from the micro batch's (CP-local) [b, S] token mask: under
    sequence parallelism each TP rank's routers see its contiguous 1/tp of the sequence."""
    if s_local == loss_mask.shape[1]:
        return loss_mask
    tp_rank = megatron_groups()[2].get_tensor_model_parallel_rank()
    return loss_mask[:, tp_rank * s_local:(tp_rank + 1) * s_local]


def routing_changes(old: torch.Tensor, new: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """[changed, decisions]: how many (token, layer) routing decisions of the tokens in ``token_mask`` [b, s]
    chose a different top-k *set* in ``new`` than in ``old`` (both [b, L, s, k]), out of how many. float64 [2]."""
    if new.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=token_mask.device)
    differs = (old.sort(dim=-1).values != new.sort(dim=-1).values).any(dim=-1)  # [b, L, s]
    keep = token_mask.bool().unsqueeze(1).expand_as(differs)
    return torch.stack([(differs & keep).sum(), keep.sum()]).double()
