"""On a CUDA machine (bench/gpu_check.sh): the device paths equal the CPU's on the same weights and batch.

``tests/gpu/paths.py`` runs twice in fresh processes: on the GPU, and with CUDA hidden (the CPU reference,
megatron-core patched for the CPU as in every other test). Compared (fp32, TF32 off):
- every parameter on the GPU (megatron's CPU-created MoE router weights included), the log-prob pass's results on
  the device, the update step's back on the CPU;
- old-policy log-probs and entropies (1e-4 absolute), the loss and gradient norm (1e-4 relative), the sequence
  log-ratios (1e-5 absolute), every weight's clipped step (1e-3 of the largest);
- bf16 (the non-distributed optimizer, whose fp32 master copies are made from the parameters where they are):
  a finite, successful step, loss within 5% of the CPU's bf16;
- ``score``: Megatron equal to ``transformers`` (1e-4 relative) on each device;
- packed rows (``parallel.pack_sequences``: TE's THD attention on the GPU with TransformerEngine, the mask on the
  CPU) equal padded rows in log-probs, loss, gradient norm and step, on each device;
- with TransformerEngine: grouped-GEMM experts (TEGroupedMLP) give SequentialMLP's fp32 passes and step, and so
  do TE's fused permutation and RoPE (``performance``) against the unfused ones;
- the fusions that default to on under CUDA (torch.compile'd SwiGLU and residual add) are on in the GPU run;
- the optimizer state in host memory (``optimizer.offload_fraction``, megatron's HybridDeviceOptimizer; CUDA only):
  the distributed optimizer's step with the whole state offloaded equals the step without offload in fp32 (loss
  1e-6 and gradient norm 1e-5 relative, every weight's step 1e-5 of the largest: Adam on the host and on the GPU,
  the same fp32 arithmetic but for rounding), and in bf16 with bf16 gradient buffers, the whole state or half of it
  offloaded, every updated weight within one bf16 ulp (2^-7 relative) of the step without offload (gradient norm
  1e-2: megatron takes it over the hybrid optimizer's bf16 gradients in bf16); Adam's moments
  sit on the CPU for the offloaded share and on the GPU for the rest.
Then the trainer itself for two steps on the GPU (local engine, NCCL world of one).

Skipped without CUDA. ``GSPO_GPU_TESTS_ON_CPU=1`` runs the harness with both sides on the CPU, to check it
before spending GPU time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ON_CPU = os.environ.get("GSPO_GPU_TESTS_ON_CPU") == "1"
pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason="needs CUDA (bench/gpu_check.sh)"),
              pytest.mark.megatron]  # builds the policy in a subprocess


def run_paths(hf_dir: Path, out: Path, cpu: bool, *scope: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if cpu:
        env.update(CUDA_VISIBLE_DEVICES="", GSPO_MEGATRON_ALLOW_CPU="1")
    done = subprocess.run([sys.executable, "-m", "tests.gpu.paths", str(hf_dir), str(out), *scope], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.model.hf_tiny import save_variant

    work = tmp_path_factory.mktemp("gpu_paths")
    hf_dir = save_variant("qwen3_moe", work)
    cpu = run_paths(hf_dir, work / "cpu.pt", cpu=True)
    # In CPU mode both sides would be the same CPU run: one serves as both, checking the harness's comparisons.
    return (cpu if ON_CPU else run_paths(hf_dir, work / "device.pt", cpu=False)), cpu


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def test_everything_lives_on_the_device(runs):
    device, cpu = runs
    expected = "cpu" if ON_CPU else "cuda"
    assert device["device"].startswith(expected) and cpu["device"] == "cpu"
    for dtype in ("fp32", "bf16"):
        assert device[dtype]["param_devices"] == [expected], device[dtype]["param_devices"]
        assert device[dtype]["pass_devices"] == [expected]
        assert device[dtype]["update_devices"] == ["cpu"]  # results come back explicitly


def test_fp32_passes_and_step_equal_the_cpu(runs):
    device, cpu = runs
    d, c = device["fp32"], cpu["fp32"]
    assert (d["logprobs"] - c["logprobs"]).abs().max() <= 1e-4
    assert (d["entropy"] - c["entropy"]).abs().max() <= 1e-4
    assert d["update_successful"] and c["update_successful"]
    assert rel(d["loss"], c["loss"]) <= 1e-4 and rel(d["grad_norm"], c["grad_norm"]) <= 1e-4
    assert c["grad_norm"] > 0.05  # the step was clipped (clip_grad 0.05): the norm's value shapes the weights
    assert (d["seq_log_ratio"] - c["seq_log_ratio"]).abs().max() <= 1e-5
    scale = max(step.abs().max().item() for step in c["step"].values())
    diff = max((d["step"][k] - c["step"][k]).abs().max().item() for k in c["step"])
    assert scale > 1e-3 and diff <= 1e-3 * scale, (diff, scale)


def test_offloaded_optimizer_step_equals_the_step_on_the_gpu(runs):
    device, _ = runs
    if "offload" not in device:
        pytest.skip("the offloaded optimizer runs on CUDA streams only: not run in CPU mode")
    runs_by_dtype = device["offload"]
    for dtype, by_fraction in runs_by_dtype.items():
        plain = by_fraction[0]
        assert plain["optimizer_state"]["exp_avg_elements"].keys() == {"cuda"}, plain["optimizer_state"]
        for fraction, run in by_fraction.items():
            if not fraction:
                continue
            where = run["optimizer_state"]
            assert where["classes"] == ["HybridDeviceOptimizer"], (dtype, fraction, where)
            on = where["exp_avg_elements"]
            assert on.get("cpu", 0) > 0 and (fraction == 1) == ("cuda" not in on), (dtype, fraction, on)
            assert run["update_successful"] and plain["update_successful"]
            assert rel(run["loss"], plain["loss"]) <= 1e-6, (dtype, fraction)
            # megatron's norm over the hybrid optimizer's bf16 gradients is a bf16 norm per tensor (2^-8)
            norm_rtol = 1e-5 if dtype == "fp32" else 1e-2
            assert plain["grad_norm"] > 0.05, dtype  # clipped (clip_grad 0.05)
            assert rel(run["grad_norm"], plain["grad_norm"]) <= norm_rtol, (dtype, fraction)
            if dtype == "fp32":
                scale = max(step.abs().max().item() for step in plain["step"].values())
                diff = max((run["step"][k] - plain["step"][k]).abs().max().item() for k in plain["step"])
                assert scale > 1e-3 and diff <= 1e-5 * scale, (fraction, diff, scale)
            else:
                for name, weight in plain["end"].items():
                    gap = (run["end"][name] - weight).abs()
                    assert (gap <= 2**-7 * weight.abs()).all(), (fraction, name, gap.max().item())
                assert any(step.abs().max() > 0 for step in run["step"].values())


def test_bf16_step_is_finite_and_close(runs):
    device, cpu = runs
    d, c = device["bf16"], cpu["bf16"]
    assert d["update_successful"] and torch.isfinite(torch.tensor(d["loss"])) and d["grad_norm"] > 0
    assert rel(d["loss"], c["loss"]) <= 0.05, (d["loss"], c["loss"])


def test_grouped_gemm_experts_step_equals_sequential(runs):
    """With TE: TEGroupedMLP's experts (grouped GEMM) give SequentialMLP's log-probs, loss, gradient norm and step."""
    device, _ = runs
    if "grouped" not in device:
        pytest.skip("TransformerEngine is not installed here: no grouped-GEMM experts to run")
    grouped, sequential = device["grouped"]["true"], device["grouped"]["false"]
    assert any(".linear_fc1.weight0" in n for n in grouped["expert_params"]), grouped["expert_params"][:4]
    assert all(".local_experts." in n for n in sequential["expert_params"])
    assert (grouped["logprobs"] - sequential["logprobs"]).abs().max() <= 1e-4
    assert rel(grouped["loss"], sequential["loss"]) <= 1e-4
    assert rel(grouped["grad_norm"], sequential["grad_norm"]) <= 1e-4
    scale = max(step.abs().max().item() for step in sequential["step"].values())
    diff = max((grouped["step"][k] - sequential["step"][k]).abs().max().item() for k in sequential["step"])
    assert diff <= 1e-3 * scale, (diff, scale)


def test_te_fusions_step_equals_unfused(runs):
    """With TE: moe_permute_fusion and apply_rope_fusion reach megatron and change the fp32 step by rounding only."""
    device, cpu = runs
    if not ON_CPU:  # null resolves to on under CUDA for the torch.compile'd fusions
        assert device["fp32"]["fusions"]["bias_activation_fusion"] and device["fp32"]["fusions"]["bias_dropout_fusion"]
    assert not cpu["fp32"]["fusions"]["bias_activation_fusion"]
    if "te_fusions" not in device:
        pytest.skip("TransformerEngine is not installed here: no fused permutation or RoPE to run")
    fused, unfused = device["te_fusions"]["true"], device["te_fusions"]["false"]
    assert fused["fusions"]["moe_permute_fusion"] and fused["fusions"]["apply_rope_fusion"]
    assert not unfused["fusions"]["moe_permute_fusion"] and not unfused["fusions"]["apply_rope_fusion"]
    assert (fused["logprobs"] - unfused["logprobs"]).abs().max() <= 1e-4
    assert rel(fused["loss"], unfused["loss"]) <= 1e-4 and rel(fused["grad_norm"], unfused["grad_norm"]) <= 1e-4
    scale = max(step.abs().max().item() for step in unfused["step"].values())
    diff = max((fused["step"][k] - unfused["step"][k]).abs().max().item() for k in unfused["step"])
    assert diff <= 1e-3 * scale, (diff, scale)


def test_packed_rows_equal_padded(runs):
    """Packed rows (TE's THD attention on the GPU with TransformerEngine, the block-diagonal mask on the CPU) give
    the padded rows' fp32 log-probs on every real position (1e-4), loss, gradient norm (1e-4) and step (1e-3)."""
    from tests.gpu.paths import SEQ, rollout

    lengths = rollout()["seq_lengths"]
    real = torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)
    device, cpu = runs
    assert cpu["packed"]["packing"] == "mask"
    for run in runs:
        packed, padded = run["packed"], run["fp32"]
        assert packed["update_successful"], run["device"]
        assert (packed["logprobs"] - padded["logprobs"])[real].abs().max() <= 1e-4, run["device"]
        assert (packed["entropy"] - padded["entropy"])[real].abs().max() <= 1e-4, run["device"]
        assert rel(packed["loss"], padded["loss"]) <= 1e-4 and rel(packed["grad_norm"], padded["grad_norm"]) <= 1e-4
        scale = max(step.abs().max().item() for step in padded["step"].values())
        diff = max((packed["step"][k] - padded["step"][k]).abs().max().item() for k in padded["step"])
        assert diff <= 1e-3 * scale, (run["device"], diff, scale)


def test_score_equals_transformers(runs):
    for run in runs:
        for mine, theirs in zip(run["score"]["megatron"], run["score"]["transformers"]):
            assert mine["num_tokens"] == theirs["num_tokens"]
            assert rel(mine["logprob_sum"], theirs["logprob_sum"]) <= 1e-4, (mine, theirs)


@pytest.mark.skipif(ON_CPU, reason="the trainer on the CPU runs in tests/train and tests/test_launch_cluster.py")
def test_trainer_runs_two_steps_on_the_gpu(tmp_path):
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
           "rollout.engine=local", "train.steps=2", "train.eval_every=0", "model.warm_start_steps=2",
           "rollout.prompts_per_step=4", "parallel.micro_batch_size=8", f"model.hf_dir={tmp_path / 'model'}",
           f"logging.dir={tmp_path}", "checkpoint.dir=", "logging.plot_every=0"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # The local engine samples with transformers (CPU) from the synced weights; the trainer scores on the GPU.
    assert max(r["logprob_diff_max"] for r in records) < 1e-3, [r["logprob_diff_max"] for r in records]
