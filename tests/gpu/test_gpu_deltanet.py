"""On a CUDA machine (bench/gpu_check.sh): the gated-DeltaNet hybrid's policy step on fla's kernels equals the CPU's.

The tiny Qwen3.5-MoE (``hf_tiny.HYBRID_VARIANTS``: three DeltaNet layers and a gated attention layer, its
vision-language checkpoint) through ``tests/gpu/paths.py``'s policy runs, once on the GPU, where megatron's
GatedDeltaNet calls flash-linear-attention's Triton kernels (the provider applies ``patches/megatron_gated_deltanet``
only without CUDA), and once with CUDA hidden (``ops.gated_delta_rule``, the pure-torch rule). Compared as the
Qwen3-MoE paths are (fp32, TF32 off in torch): old-policy log-probs and entropies (1e-4 absolute), loss and gradient
norm (1e-4 relative), sequence log-ratios (1e-5), every weight's clipped step (1e-3 of the largest); bf16: a finite,
successful step with the loss within 5% of the CPU's bf16. fla's kernels run their fp32 dots in Triton's default
precision: where that is TF32 the fp32 bounds above are what the check measures, not an assumption.

Skipped without CUDA, and on CUDA without fla (bench/gpu_wheels.sh carries its wheels; setup.py's gpu extra installs
it). ``GSPO_GPU_TESTS_ON_CPU=1`` runs the harness with both sides on the CPU.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import transformers

from tests.gpu.test_gpu_paths import rel, run_paths

ON_CPU = os.environ.get("GSPO_GPU_TESTS_ON_CPU") == "1"
pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason="needs CUDA (bench/gpu_check.sh)"),
              pytest.mark.skipif(torch.cuda.is_available() and importlib.util.find_spec("fla") is None,
                                 reason="flash-linear-attention is not installed (bench/gpu_wheels.sh carries it)"),
              pytest.mark.skipif(not hasattr(transformers, "Qwen3_5MoeConfig"),
                                 reason=f"transformers {transformers.__version__} has no Qwen3.5-MoE to build"),
              pytest.mark.megatron]  # builds the policy in a subprocess


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.model.hf_tiny import save_variant

    work = tmp_path_factory.mktemp("gpu_deltanet")
    hf_dir = save_variant("qwen3_5_moe", work)
    cpu = run_paths(hf_dir, work / "cpu.pt", True, "policy")
    return (cpu if ON_CPU else run_paths(hf_dir, work / "device.pt", False, "policy")), cpu


def test_the_delta_rule_is_fla_on_the_gpu_and_torch_on_the_cpu(runs):
    device, cpu = runs
    assert cpu["deltanet_kernel"] == "gspo_megatron.ops.gated_delta_rule", cpu["deltanet_kernel"]
    if not ON_CPU:
        assert device["device"].startswith("cuda") and device["deltanet_kernel"].startswith("fla."), device
    for run in runs:
        for dtype in ("fp32", "bf16"):
            assert run[dtype]["param_devices"] == [run["device"].split(":")[0]], (run["device"], dtype)


def test_fp32_passes_and_step_equal_the_cpu(runs):
    device, cpu = runs
    d, c = device["fp32"], cpu["fp32"]
    assert (d["logprobs"] - c["logprobs"]).abs().max() <= 1e-4
    assert (d["entropy"] - c["entropy"]).abs().max() <= 1e-4
    assert d["update_successful"] and c["update_successful"]
    assert rel(d["loss"], c["loss"]) <= 1e-4 and rel(d["grad_norm"], c["grad_norm"]) <= 1e-4
    assert (d["seq_log_ratio"] - c["seq_log_ratio"]).abs().max() <= 1e-5
    scale = max(step.abs().max().item() for step in c["step"].values())
    diff = max((d["step"][k] - c["step"][k]).abs().max().item() for k in c["step"])
    assert scale > 1e-3 and diff <= 1e-3 * scale, (diff, scale)
    # every DeltaNet weight moved (A_log, dt_bias, conv1d, in_proj's sections, the gated norm)
    deltanet = [k for k in c["step"] if ".linear_attn." in k]
    assert deltanet and all(c["step"][k].abs().max() > 0 for k in deltanet), deltanet


def test_bf16_step_is_finite_and_close(runs):
    device, cpu = runs
    d, c = device["bf16"], cpu["bf16"]
    assert d["update_successful"] and torch.isfinite(torch.tensor(d["loss"])) and d["grad_norm"] > 0
    assert rel(d["loss"], c["loss"]) <= 0.05, (d["loss"], c["loss"])
