"""rollout.colocate through the real CLI: the tiny CPU example (world 1) with its launched SGLang server colocated.
Every step releases the server's memory after the rollout and syncs through update_weights_from_tensor (resuming
the weights, then the KV cache); each later step's rollout log-probs then equal the trainer's (fp32, as with
separate servers: ``tests/test_cpu_example.py``). On CPU the release frees nothing (``tests/rollout/test_colocate.py``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from gspo_megatron.train.startup.config import ConfigError, load_config
from tests import warm_cli
from tests.rollout.helpers import require_sglang

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.megatron  # trains the Megatron policy through the CLI
def test_colocated_loop_syncs_by_tensor_and_matches_the_trainer(tmp_path):
    require_sglang()
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
           "rollout.colocate=true", "train.steps=3", "train.eval_every=2", "model.warm_start_steps=5",
           "rollout.prompts_per_step=4", "parallel.micro_batch_size=8", f"model.hf_dir={tmp_path / 'model'}",
           f"logging.dir={tmp_path / 'run'}", "checkpoint.dir=", "logging.plot_every=0"]
    env = dict(os.environ, WORLD_SIZE="1", OMP_NUM_THREADS="1")
    out = warm_cli.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    diffs = [r["logprob_diff_max"] for r in records]
    print("colocated: logprob_diff_max per step", diffs, "release s", [r["colocate/release_seconds"] for r in records],
          "sync s", [r["weight_sync/seconds"] for r in records])
    # Steps 2 and 3 roll out with the weights step 1 and 2 wrote through tensor handles: fp32 agreement.
    assert max(diffs) < 1e-4, diffs
    assert all(r["weight_sync/tensors"] > 0 and r["colocate/release_seconds"] >= 0 for r in records), records
    assert "eval_reward_mean" in records[1]  # the eval after step 2's sync generated on resumed servers


@pytest.mark.parametrize("override, message", [
    ("rollout.mode=one_step_off", "rollout.mode=sync"),
    ("rollout.engine=local", "rollout.engine=sglang"),
    ("rollout.weight_sync=disk", "tensor handles"),
    ("rollout.urls=[http://10.0.0.2:30000]", "leave rollout.urls empty"),
])
def test_colocate_refuses_what_it_cannot_do(override, message):
    from gspo_megatron.train.sampling import colocate

    cfg = load_config(ROOT / "examples/tiny_moe_cpu.yaml", ["rollout.colocate=true", override])
    with pytest.raises(ConfigError, match=message):
        colocate.validate(cfg)
    colocate.validate(load_config(ROOT / "examples/tiny_moe_cpu.yaml", ["rollout.colocate=true"]))


def test_plan_gives_both_sides_peaks_and_refuses_naming_the_knob():
    """Qwen3-30B-A3B on 2 x 8 H100s with its servers colocated (estimates: no GPU here): the trainer keeps ~49 GiB
    through the rollout, so the servers' static pool must stay under ~0.36 of the GPU; one engine per 8 GPUs
    (tp_size 8) holds 7.1 GiB of weights per GPU, and 0.3 leaves 16.6 GiB of KV cache per GPU."""
    from gspo_megatron.model.hf_config import read_hf_config as model_spec
    from gspo_megatron.plan import colocated
    from gspo_megatron.plan.memory import GIB, estimate_memory, padded_length
    from gspo_megatron.plan.layouts import fits, format_plan, read_hf_config

    base = ["rollout.colocate=true", "rollout.urls=[]"]
    config = ROOT / "examples/qwen3_30b_a3b/train.yaml"

    def plan(*overrides):
        cfg = load_config(config, [*base, *overrides])
        spec = model_spec(read_hf_config(cfg))
        return cfg, colocated.colocated_plan(cfg, spec, estimate_memory(spec, cfg, 16, padded_length(cfg)), 79.1)

    cfg, good = plan("rollout.server_args.tp_size=8", "rollout.server_args.mem_fraction_static=0.3")
    assert good.fits and fits(cfg, 16), good.problems
    phases = {p.phase: p for p in good.phases}
    assert phases["train"].engine == colocated.ENGINE_RESIDUAL_GIB * GIB  # released while training
    assert phases["sync"].engine == pytest.approx(good.engine_weights + colocated.ENGINE_RESIDUAL_GIB * GIB)
    assert 0.3 < good.largest_fraction < 0.4 and good.kv_cache > good.kv_needed
    assert all(p.total <= 79.1 * GIB for p in good.phases)
    text = format_plan(cfg, 16)
    assert "colocated (rollout.colocate)" in text and "colocated: fits" in text

    cfg, greedy = plan("rollout.server_args.tp_size=8", "rollout.server_args.mem_fraction_static=0.6")
    assert not fits(cfg, 16)
    assert any("mem_fraction_static=0.6 (--mem-fraction-static) leaves the trainer too little" in p for p in greedy.problems), greedy.problems
    _, small = plan("rollout.server_args.tp_size=8", "rollout.server_args.mem_fraction_static=0.1")
    assert any("KV cache" in p for p in small.problems), small.problems
    _, unset = plan("rollout.server_args.tp_size=8")
    assert any("needs rollout.server_args.mem_fraction_static" in p for p in unset.problems), unset.problems
    _, one_gpu_engine = plan("rollout.server_args.mem_fraction_static=0.3")  # 57 GiB of weights per GPU
    assert any("rollout.server_args.tp_size" in p for p in one_gpu_engine.problems), one_gpu_engine.problems


@pytest.mark.megatron  # trains the Megatron policy under torchrun
def test_colocated_under_torchrun_tp2_ep2(tmp_path):
    """Four gloo ranks at TP=2 x EP=2 with rank 0's colocated server: the export gathers every shard, rank 0 writes
    the whole update through update_weights_from_tensor, the other ranks wait for the release in the control group."""
    import shutil
    import subprocess

    require_sglang()
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    cmd = [torchrun, "--standalone", "--nproc-per-node", "4", "-m", "gspo_megatron.cli", "train",
           str(ROOT / "examples/tiny_moe_cpu.yaml"), "rollout.colocate=true", "parallel.tensor=2", "parallel.expert=2",
           "train.steps=2", "train.eval_every=0", "model.warm_start_steps=5", "rollout.prompts_per_step=4",
           "parallel.micro_batch_size=8", f"model.hf_dir={tmp_path / 'model'}", f"logging.dir={tmp_path / 'run'}",
           "checkpoint.dir=", "logging.plot_every=0"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run(cmd, cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    diffs = [r["logprob_diff_max"] for r in records]
    print("colocated TP2 x EP2: logprob_diff_max per step", diffs)
    assert [r["step"] for r in records] == [1, 2] and max(diffs) < 1e-4, diffs
    assert all(r["weight_sync/tensors"] > 0 and "colocate/release_seconds" in r for r in records), records
