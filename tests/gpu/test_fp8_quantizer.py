"""On a CUDA machine (bench/gpu_check.sh): FP8 rollouts' block quantizer (``model.fp8.quantize``, the Triton kernel
on CUDA tensors) against the torch reference (``quantize_reference``) bit for bit, and its throughput.

- bf16 weights of a Qwen3-30B-A3B attention projection and a ragged shape (partial 128 x 128 edge blocks in both
  dimensions), plus a block of zeros: float8_e4m3fn bytes and fp32 scales equal bit for bit.
- What a weight sync sends from the GPU (``weight_sync.sent_tensors`` with an ``Fp8Scheme``): quantized on the
  device, each weight's scale just before it, equal to the reference.
- GB/s: a 8192 x 8192 bf16 weight (128 MiB read, 64 MiB + scales written), the median of 10 timed calls after a
  warm-up, counted as bytes read plus written per second; it must exceed 50 GB/s (a floor far under any GPU's
  memory bandwidth: what fails it is a host round trip or a launch per block row, not a slow tile).

Skipped without CUDA. ``GSPO_GPU_TESTS_ON_CPU=1`` runs the same checks on the CPU under Triton's interpreter with
small shapes (no throughput floor there), to check the harness.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

ON_CPU = os.environ.get("GSPO_GPU_TESTS_ON_CPU") == "1"
if ON_CPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first defined
pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason="needs CUDA (bench/gpu_check.sh)"),
              pytest.mark.triton]

CUDA = torch.cuda.is_available() and not ON_CPU
DEVICE = torch.device("cuda" if CUDA else "cpu")
SHAPES = [(4096, 2048), (1000, 3000)] if CUDA else [(136, 200)]  # q_proj's (out, in) of Qwen3-30B-A3B; ragged
SPEED_SHAPE = (8192, 8192) if CUDA else (256, 256)
FLOOR_GBPS = 50.0


def _weight(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-4, 1, shape[1])  # columns from small to large
    w[:128, :128] = 0.0  # a whole block of zeros: its scale is 0, its bytes 0
    return w.to(torch.bfloat16)


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0].cpu().view(torch.uint8), b[0].cpu().view(torch.uint8)) and torch.equal(a[1].cpu(), b[1].cpu())


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_quantizer_equals_the_reference_on_the_device(shape, record_property):
    from gspo_megatron.model import fp8

    weight = _weight(shape)
    got = fp8.quantize(weight.to(DEVICE)) if CUDA else fp8.quantize_triton(weight)
    assert got[0].dtype == torch.float8_e4m3fn and got[1].dtype == torch.float32 and got[0].device.type == DEVICE.type
    assert got[1].shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert _same(got, fp8.quantize_reference(weight)), shape
    record_property("figure", f"{shape[0]} x {shape[1]} bf16, 128 x 128 blocks: equal bit for bit")


def test_sync_stream_quantizes_on_the_device():
    from gspo_megatron.model import fp8
    from gspo_megatron.rollout.config import WeightSyncConfig
    from gspo_megatron.rollout.weight_sync import sent_tensors

    o_proj, norm = _weight((256, 384), seed=1).to(DEVICE), torch.ones(384, dtype=torch.bfloat16, device=DEVICE)
    config = WeightSyncConfig(fp8=fp8.Fp8Scheme(1))
    sent = list(sent_tensors([("model.layers.0.self_attn.o_proj.weight", o_proj),
                              ("model.layers.0.input_layernorm.weight", norm)], config))
    assert [n for n, _ in sent] == ["model.layers.0.self_attn.o_proj.weight_scale_inv",
                                    "model.layers.0.self_attn.o_proj.weight", "model.layers.0.input_layernorm.weight"]
    assert all(t.device.type == DEVICE.type for _, t in sent)
    assert _same((sent[1][1], sent[0][1]), fp8.quantize_reference(o_proj.cpu())) and sent[2][1] is norm


def test_triton_quantizer_throughput(record_property):
    from gspo_megatron.model import fp8

    weight = _weight(SPEED_SHAPE).to(DEVICE)
    quantize = fp8.quantize if CUDA else fp8.quantize_triton
    quantize(weight)  # compiles
    times = []
    for _ in range(10 if CUDA else 2):
        if CUDA:
            torch.cuda.synchronize()
        start = time.perf_counter()
        q, s = quantize(weight)
        if CUDA:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    moved = weight.numel() * weight.element_size() + q.numel() * q.element_size() + s.numel() * s.element_size()
    gbps = moved / seconds / 1e9
    record_property("figure", f"{SPEED_SHAPE[0]} x {SPEED_SHAPE[1]} bf16 -> fp8: {seconds * 1e3:.3f} ms, "
                              f"{gbps:.1f} GB/s (read + written)")
    if CUDA:
        assert gbps > FLOOR_GBPS, gbps
