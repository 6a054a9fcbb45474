"""Start torch.distributed and Megatron's groups for a layout, reusing groups that already fit it.

Re-creating Megatron's process groups costs seconds on gloo and leaves the old groups' threads behind (megatron
drops its references; torch keeps the groups), so a process that converts or scores several models under the
same layout builds the groups once.
"""

from __future__ import annotations

from gspo_megatron.parallel import groups
from gspo_megatron.parallel.groups import Layout


def current_sizes() -> dict | None:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return dict(tensor=ps.get_tensor_model_parallel_world_size(), pipeline=ps.get_pipeline_model_parallel_world_size(),
                expert=ps.get_expert_model_parallel_world_size(), context=ps.get_context_parallel_world_size(),
                expert_tensor=ps.get_expert_tensor_parallel_world_size())


def ensure_model_parallel(layout: Layout) -> None:
    """``groups.init_distributed()``, then ``groups.init_model_parallel(layout)`` unless the groups already fit."""
    from patches import megatron_cpu

    groups.init_distributed()
    megatron_cpu.apply()
    wanted = dict(tensor=layout.tensor, pipeline=layout.pipeline, expert=layout.expert, context=layout.context,
                  expert_tensor=layout.expert_tensor or layout.tensor)
    if current_sizes() != wanted:
        groups.init_model_parallel(layout)
