"""Every pipeline stage's exported tensors delivered to the first stage (the weight sync through rank 0)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def pipeline_gathered(bridge, model):
    """The bridge's export, with every pipeline stage's tensors delivered to the first stage (collective).

    Stage by stage: the stage's tensor names and dtypes travel first (a small object broadcast over the PP group;
    the router's bias and torch norms are fp32 in a bf16 model), then each tensor as the stage exports it.
    First-stage ranks yield all of them, in stage order; other stages yield nothing. Peak extra memory is one tensor.
    """
    from megatron.core import parallel_state as ps

    pp_group = ps.get_pipeline_model_parallel_group()
    pp_size, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    if pp_size == 1:
        yield from bridge.export_hf_weights(model)
        return
    shapes = bridge.hf_tensor_shapes()
    device = next(model.parameters()).device
    for stage in range(pp_size):
        src = dist.get_global_rank(pp_group, stage)
        dtypes = [bridge.export_dtypes(model) if pp_rank == stage else None]
        dist.broadcast_object_list(dtypes, src=src, group=pp_group)
        if pp_rank == stage:
            for name, tensor in bridge.export_hf_weights(model):
                if stage != 0:
                    dist.broadcast(tensor.contiguous(), src=src, group=pp_group)
                else:
                    yield name, tensor
        elif stage != 0:  # the first stage's tensors stay where they are
            for name, dtype in dtypes[0].items():
                received = torch.empty(shapes[name], dtype=dtype, device=device)
                dist.broadcast(received, src=src, group=pp_group)
                if pp_rank == 0:
                    yield name, received
