"""The trainer's side of colocated rollouts on a GPU (``bench/gpu_check.sh``; SGLang is not on the check machine):

- the bucketed export as SGLang receives it (``rollout.colocate.pack`` + ``serialize``: flattened buckets pickled as
  handles) is opened by a *second process* and holds the exact tensors: CUDA IPC handles on a GPU (the device named
  by UUID, mapped back as SGLang's ``_rebuild_cuda_tensor_modified`` does), shared-memory file names on the CPU
  (that half also runs here, without a GPU);
- the trainer's optimizer state offloaded to pinned host memory (``TrainerState``, ``rollout.colocate_offload``)
  gives its GPU memory back (``torch.cuda.memory_reserved`` drops by about its size) and is regained unchanged
  (CUDA only).

Written without a GPU to run it (this session had none): what it measures is not yet in bench/RESULTS.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_megatron.rollout.colocate import pack, serialize
from gspo_megatron.rollout.weight_sync import buckets

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()

RECEIVER = r'''
import base64, pickle, sys
import torch
import torch.multiprocessing  # torch's reducers
from torch.multiprocessing import reductions

original = reductions.rebuild_cuda_tensor

def by_uuid(*args):  # SGLang's _rebuild_cuda_tensor_modified: the sender names its GPU by UUID
    device = args[6]
    if isinstance(device, str):
        device = next(i for i in range(torch.cuda.device_count())
                      if str(torch.cuda.get_device_properties(i).uuid) == device)
    return original(*args[:6], device, *args[7:])

reductions.rebuild_cuda_tensor = by_uuid
for line in sys.stdin:
    bucket = pickle.loads(base64.b64decode(line))
    flat = bucket["flattened_tensor"]
    for meta in bucket["metadata"]:
        t = flat[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)
        print(meta.name, flat.device.type, repr(float(t.double().sum())), flush=True)
'''


def _weights(device) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    shapes = [(64, 32), (32,), (128, 64), (7, 5), (1000,)]
    return [(f"w{i}", torch.randn(s, generator=g).to(device)) for i, s in enumerate(shapes)] + \
        [("half", torch.randn(40, 8, generator=g).to(device, torch.bfloat16))]


def test_bucketed_handles_open_in_a_second_process():
    device = torch.device("cuda" if CUDA else "cpu")
    named = _weights(device)
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    received, buffer = [], None
    try:
        for bucket in buckets(iter(named), bucket_bytes=16384):
            flat, buffer = pack(bucket, buffer, None)  # one reused buffer: each bucket is read before the next
            receiver.stdin.write(serialize(flat) + "\n")
            receiver.stdin.flush()
            for _ in bucket:
                received.append(receiver.stdout.readline().split())
    finally:
        receiver.stdin.close()
        receiver.wait(timeout=60)
    assert receiver.returncode == 0
    expected = [(n, device.type, float(t.double().sum())) for n, t in named]
    assert [(n, d) for n, d, _ in received] == [(n, d) for n, d, _ in expected]
    assert [float(s) for _, _, s in received] == pytest.approx([s for _, _, s in expected], rel=1e-12, abs=1e-9)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (bench/gpu_check.sh): GPU memory released and regained")
def test_optimizer_state_offload_gives_gpu_memory_back():
    """``TrainerState`` (``rollout.colocate_offload=optimizer``) on a GPU: a bf16 model's fp32 master weights and
    Adam moments go to pinned host memory, ``torch.cuda.memory_reserved`` drops by about their size, and ``reload``
    regains them unchanged (the CPU half of this, freed storages and exact values: ``tests/train/sampling``)."""
    from gspo_megatron.train.sampling.colocate import TrainerState

    model = torch.nn.Linear(4096, 4096, device="cuda", dtype=torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.Adam(master)
    for p, q in zip(master, model.parameters()):
        p.grad = torch.randn_like(p)
    optimizer.step()
    state = {k: v.clone() for k, v in optimizer.state[master[0]].items() if isinstance(v, torch.Tensor)}
    weights = master[0].detach().clone()
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    offload = TrainerState(model, optimizer, torch.device("cuda", torch.cuda.current_device()), "optimizer")
    moved = offload.offload()["colocate/offload_bytes"]
    released = torch.cuda.memory_reserved()
    print(f"optimizer state {moved / 2**20:.0f} MiB: reserved {before / 2**20:.0f} -> {released / 2**20:.0f} MiB")
    assert moved >= 3 * 4096 * 4096 * 4  # the weight's master copy, exp_avg and exp_avg_sq
    assert before - released >= 0.9 * moved
    assert optimizer.state[master[0]]["exp_avg"].is_pinned() and not master[0].is_cuda
    offload.reload()
    regained = torch.cuda.memory_reserved()
    print(f"reloaded: reserved {regained / 2**20:.0f} MiB")
    assert regained - released >= 0.9 * moved and master[0].is_cuda
    assert torch.equal(master[0], weights)
    for key, value in state.items():
        assert torch.equal(optimizer.state[master[0]][key], value), key
    optimizer.step()  # the reloaded state works
