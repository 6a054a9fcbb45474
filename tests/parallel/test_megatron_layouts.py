"""Real Megatron-Core on gloo: every parallel layout equals the world=1 reference.

Same weights (the world=1 model saved as a torch_dist checkpoint and loaded through dist_checkpointing
resharding), same global batch (split over data-parallel ranks), micro batches of 1 through
``get_forward_backward_func``. Logits, the loss and every gradient shard must match the reference to
1e-5 relative (fp32; max |a - e| / max |e| per tensor).
"""

from __future__ import annotations

import os

import pytest
import torch

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from tests import megatron_tiny as tiny

pytestmark = pytest.mark.megatron  # builds a Megatron model

RTOL = 1e-5


def reference(ckpt_dir: str):
    """world=1: save weights, gradients, logits and loss of the reference model."""
    from megatron.core import dist_checkpointing

    model = tiny.build_model()
    for name in ("weights", "grads"):
        os.makedirs(f"{ckpt_dir}/{name}")
    dist_checkpointing.save(tiny.tensors_only(model.sharded_state_dict()), f"{ckpt_dir}/weights")
    ddp = tiny.wrap_ddp(model)
    loss, logits = tiny.forward_backward(ddp, tiny.global_batch())
    dist_checkpointing.save(tiny.grads_sharded_state_dict(ddp.module), f"{ckpt_dir}/grads")
    torch.save({"loss": loss, "logits": logits}, f"{ckpt_dir}/outputs.pt")
    return {"loss": loss.item(), "num_params": sum(p.numel() for p in model.parameters())}


def compare_layout(ckpt_dir: str, layout: Layout, dispatcher: str) -> dict:
    """Build the layout's model from the reference checkpoint, run the step, diff against the reference."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from gspo_megatron.parallel import groups

    groups.init_model_parallel(layout)
    model = tiny.build_model(dispatcher, seed=1 + torch.distributed.get_rank())  # different init: the load must overwrite it
    loaded = dist_checkpointing.load(tiny.tensors_only(model.sharded_state_dict()), f"{ckpt_dir}/weights")
    model.load_state_dict(loaded)
    ddp = tiny.wrap_ddp(model)
    loss, logits = tiny.forward_backward(ddp, tiny.local_batch())

    ref = torch.load(f"{ckpt_dir}/outputs.pt")
    diffs = {}
    if ps.is_pipeline_last_stage():
        dp_group = ps.get_data_parallel_group()
        torch.distributed.all_reduce(loss, group=dp_group)
        loss /= ps.get_data_parallel_world_size()
        diffs["loss"] = abs(loss.item() - ref["loss"].item()) / abs(ref["loss"].item())
        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        shard = tiny.VOCAB // tp
        per_dp = len(logits)
        first = ps.get_data_parallel_rank() * per_dp
        diffs["logits"] = max(
            tiny.max_rel_diff(local, ref["logits"][first + j][..., tp_rank * shard : (tp_rank + 1) * shard])
            for j, local in enumerate(logits)
        )
    ref_grads = tiny.flat(dist_checkpointing.load(tiny.empty_like_sharded(ddp.module), f"{ckpt_dir}/grads"))
    grads = tiny.flat(tiny.grads_sharded_state_dict(ddp.module))
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    diffs["grads"] = max(tiny.max_rel_diff(grads[k], ref_grads[k]) for k in grads)
    diffs["num_grads"] = len(grads)
    diffs["grad_norm"] = sum(g.float().square().sum().item() for g in grads.values())
    return diffs


def check_layouts(ckpt_dir: str, cases: list[tuple[str, Layout, str]]) -> dict:
    """Many layouts in one launch: process-group start-up dominates, so reuse it."""
    return {name: compare_layout(ckpt_dir, layout, dispatcher) for name, layout, dispatcher in cases}


@pytest.fixture(scope="module")
def reference_ckpt(tmp_path_factory):
    ckpt_dir = str(tmp_path_factory.mktemp("reference"))
    (result,) = run_on_ranks(reference, 1, Layout(), ckpt_dir)
    assert result["num_params"] > 0
    return ckpt_dir


TWO_RANK_CASES = [
    ("tp2_sp", Layout(tensor=2, sequence_parallel=True), "alltoall"),
    ("pp2_1f1b", Layout(pipeline=2), "alltoall"),
    ("ep2_alltoall", Layout(expert=2), "alltoall"),
    ("ep2_allgather", Layout(expert=2), "allgather"),
]
FOUR_RANK_CASES = [
    ("tp2_ep2_alltoall", Layout(tensor=2, expert=2, sequence_parallel=True), "alltoall"),
    ("tp2_ep2_allgather", Layout(tensor=2, expert=2, sequence_parallel=True), "allgather"),
]


def _assert_matches(results: list[dict], cases):
    for name, _, _ in cases:
        per_rank = [r[name] for r in results]
        for rank, diffs in enumerate(per_rank):
            assert diffs["grads"] <= RTOL, f"{name} rank {rank}: grads rel diff {diffs['grads']:.2e}"
            if "loss" in diffs:
                assert diffs["loss"] <= RTOL, f"{name} rank {rank}: loss rel diff {diffs['loss']:.2e}"
                assert diffs["logits"] <= RTOL, f"{name} rank {rank}: logits rel diff {diffs['logits']:.2e}"
        # Every rank compared something, and the last stage saw the loss.
        assert all(d["num_grads"] > 0 for d in per_rank), name
        assert any("loss" in d for d in per_rank), name


def test_two_rank_layouts_equal_reference(reference_ckpt):
    results = run_on_ranks(check_layouts, 2, None, reference_ckpt, TWO_RANK_CASES)
    _assert_matches(results, TWO_RANK_CASES)


def test_four_rank_tp2_ep2_equals_reference(reference_ckpt):
    results = run_on_ranks(check_layouts, 4, None, reference_ckpt, FOUR_RANK_CASES)
    _assert_matches(results, FOUR_RANK_CASES)
