"""rollout.colocate through the real CLI: the tiny CPU example (world 1) with its launched SGLang server colocated.
Every step releases the server's memory after the rollout and syncs through update_weights_from_tensor (resuming
the weights, then the KV cache); each later step's rollout log-probs then equal the trainer's (fp32, as with
separate servers: ``tests/test_launch_cluster.py``), and its updates (the optimizer state offloaded between them)
equal a plain run's on the same rollouts. On CPU the release frees nothing (``tests/rollout/test_colocate.py``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.train.startup.config import ConfigError, load_config
from tests import warm_cli
from tests.train.saved import final_weights
from tests.rollout.helpers import require_sglang

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.megatron  # trains the Megatron policy through the CLI
def test_colocated_loop_syncs_by_tensor_matches_the_trainer_and_trains_as_a_plain_run(tmp_path):
    require_sglang()
    (tmp_path / "rollouts").mkdir()
    records = _run(tmp_path, "run", "rollout.colocate=true", "rollout.colocate_offload=optimizer",
                   RECORD_ROLLOUTS=str(tmp_path / "rollouts"))
    assert [r["step"] for r in records] == [1, 2, 3]
    diffs = [r["logprob_diff_max"] for r in records]
    print("colocated: logprob_diff_max per step", diffs, "release s", [r["colocate/release_seconds"] for r in records],
          "sync s", [r["weight_sync/seconds"] for r in records], "bytes offloaded",
          [r["colocate/offload_bytes"] for r in records], "grad buffers",
          [r["colocate/grad_buffer_bytes"] for r in records],
          "offload s", [r["colocate/offload_seconds"] for r in records], "reload s",
          [r.get("colocate/reload_seconds") for r in records])
    # Steps 2 and 3 roll out with the weights step 1 and 2 wrote through tensor handles: fp32 agreement.
    assert max(diffs) < 1e-4, diffs
    assert all(r["weight_sync/tensors"] > 0 and r["colocate/release_seconds"] >= 0 for r in records), records
    assert "eval_reward_mean" in records[1]  # the eval after step 2's sync generated on resumed servers
    # rollout.colocate_offload=optimizer: the optimizer state on the host and the gradient buffers freed between
    # updates; Adam's moments offloaded after step 1 and reloaded for step 2; step 2's checkpoint written from the
    # host copies.
    assert (tmp_path / "run" / "ck" / "latest").read_text() == "step_000003"
    assert all(r["colocate/offload_bytes"] > 0 and r["colocate/grad_buffer_bytes"] > 0 for r in records), records
    assert all(r["colocate/reload_seconds"] >= 0 for r in records[1:]) and "colocate/reload_seconds" not in records[0]

    # Colocation and the offload change nothing in training: a plain run (no colocation, the local engine) that
    # trains on this run's recorded rollouts (tests/record_rollouts.py: SGLang's CPU server samples from its
    # scheduler's RNG, so two runs' rollouts differ) has the same losses and gradient norms at every step, and the
    # same weights and optimizer state after step 2, bit for bit.
    plain = _run(tmp_path, "plain", "rollout.engine=local", REPLAY_ROLLOUTS=str(tmp_path / "rollouts"))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in plain] == [r[key] for r in records], key
    (base, off), = run_on_ranks(final_weights, 1, None, str(tmp_path / "plain" / "ck" / "step_000002"),
                                str(tmp_path / "run" / "ck" / "step_000002"), optimizer=True)
    assert base.keys() == off.keys() and any(k.startswith("optimizer") for k in base) and len(base) > 10
    different = [k for k in base if not torch.equal(base[k], off[k])]
    assert not different, f"the colocated, offloaded run's step-2 weights / optimizer state differ: {different[:5]}"


def _run(tmp_path, name: str, *overrides: str, **env: str) -> list[dict]:
    """The CPU example at world 1 for 3 steps through ``tests.record_rollouts`` (``env``: RECORD_ROLLOUTS or
    REPLAY_ROLLOUTS), an eval after step 2 and a checkpoint every 2 steps, in ``tmp_path / name``; its records."""
    cmd = [sys.executable, "-m", "tests.record_rollouts", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
           *overrides, "train.steps=3", "train.eval_every=2", "model.warm_start_steps=5",
           "rollout.prompts_per_step=4", "parallel.micro_batch_size=8", f"model.hf_dir={tmp_path / 'model'}",
           f"logging.dir={tmp_path / name}", f"checkpoint.dir={tmp_path / name / 'ck'}", "checkpoint.every=2",
           "logging.plot_every=0"]
    out = warm_cli.run(cmd, cwd=ROOT, env=dict(os.environ, WORLD_SIZE="1", OMP_NUM_THREADS="1", **env),
                       capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_trainer_state_offload_frees_the_originals_and_restores_them_exactly():
    """``TrainerState`` on the CPU (``device`` = the CPU, as in a CPU run): Adam's moments and the fp32 master
    weights of a bf16 model are copied off, their original storages freed, the model's own weights untouched; after
    ``reload`` the optimizer steps exactly as a twin that never offloaded."""
    from gspo_megatron.train.sampling.colocate import TrainerState

    model = torch.nn.Linear(16, 8).to(torch.bfloat16)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.Adam(master, lr=0.1)
    twin_master = [p.detach().clone().requires_grad_() for p in master]
    twin = torch.optim.Adam(twin_master, lr=0.1)
    g = torch.Generator().manual_seed(0)

    def step():
        grads = [torch.randn(p.shape, generator=g) for p in master]
        for params, opt in ((master, optimizer), (twin_master, twin)):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            opt.step()

    step()
    state = TrainerState(model, optimizer, torch.device("cpu"), "optimizer")
    originals = {id(v): v for s in optimizer.state.values() for v in s.values()}
    master_storages = [p.untyped_storage() for p in master]
    model_before = [p.detach().clone() for p in model.parameters()]
    metrics = state.offload()
    moments = sum(2 * p.numel() * 4 + 4 for p in master)  # exp_avg, exp_avg_sq, step
    assert metrics["colocate/offload_bytes"] == moments + sum(p.numel() * 4 for p in master)
    assert metrics["colocate/offload_seconds"] >= 0 and metrics["colocate/grad_buffer_bytes"] == 0
    assert all(v.untyped_storage().nbytes() == 0 for v in originals.values())  # freed
    assert all(id(v) not in originals for s in optimizer.state.values() for v in s.values())  # the host copies
    assert all(s.nbytes() == 0 for s in master_storages)
    for p, q in zip(master, twin_master):
        assert torch.equal(p, q)  # the master weights read from the copy
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), model_before))
    assert state.offload() == {}  # already off
    assert set(state.reload()) == {"colocate/reload_seconds"} and state.reload() == {}
    assert all(id(v) in originals for s in optimizer.state.values() for v in s.values())  # the originals again
    step()
    step()
    for p, q in zip(master, twin_master):
        assert torch.equal(p, q)
    for p, q in zip(master, twin_master):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], twin.state[q][key]), key
    assert TrainerState(model, optimizer, torch.device("cpu"), "none").offload() == {}


def test_colocate_offload_needs_colocate():
    from gspo_megatron.train.sampling import colocate

    with pytest.raises(ConfigError, match="needs rollout.colocate=true"):
        colocate.validate(load_config(ROOT / "examples/tiny_moe_cpu.yaml", ["rollout.colocate_offload=optimizer"]))
    with pytest.raises(ConfigError, match="is not one of none, optimizer"):
        colocate.validate(load_config(ROOT / "examples/tiny_moe_cpu.yaml",
                                      ["rollout.colocate=true", "rollout.colocate_offload=grads"]))
    colocate.validate(load_config(ROOT / "examples/tiny_moe_cpu.yaml",
                                  ["rollout.colocate=true", "rollout.colocate_offload=optimizer"]))


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

    # rollout.colocate_offload=optimizer: the rollout and sync phases lose the optimizer state and the gradient
    # buffers (21.3 + 16.4 GiB here), leaving the servers up to ~0.84 of the GPU; the update's peak is unchanged.
    cfg, offload = plan("rollout.server_args.tp_size=8", "rollout.server_args.mem_fraction_static=0.6",
                        "rollout.colocate_offload=optimizer")
    worst = estimate_memory(model_spec(read_hf_config(cfg)), cfg, 16, padded_length(cfg)).worst
    assert offload.offloaded == worst.optimizer + worst.grads and offload.offloaded > 30 * GIB
    kept, off = {p.phase: p for p in good.phases}, {p.phase: p for p in offload.phases}
    for phase in ("rollout", "sync"):
        assert off[phase].trainer == pytest.approx(kept[phase].trainer - offload.offloaded)
    assert off["train"].total == kept["train"].total
    assert offload.fits and 0.8 < offload.largest_fraction < 0.9, offload.problems  # 0.6 fits now, 0.36 before
    assert "rollout.colocate_offload=optimizer: 37.73 GiB per GPU off it" in format_plan(cfg, 16)


def test_several_nodes_refuse_pipeline_stages_and_listen_off_the_loopback(monkeypatch, tmp_path):
    """On several nodes each leader needs the whole export, which only first-stage ranks get: pipeline stages are
    refused before any server starts. Their servers listen on the node's address (not only the loopback), which
    launched servers may only when colocated."""
    from gspo_megatron.rollout import SGLangConfig
    from gspo_megatron.train.sampling import colocate

    monkeypatch.setattr(colocate._Nodes, "count", 2)
    cfg = load_config(ROOT / "examples/tiny_moe_cpu.yaml", ["rollout.colocate=true", "parallel.pipeline=2"])
    with pytest.raises(ConfigError, match="rollout.colocate on 2 nodes with parallel.pipeline=2"):
        colocate.engine_on_each_node(cfg, None)
    assert colocate.on_each_node()
    SGLangConfig(model_path=str(tmp_path), device="cpu", host="10.0.0.2", colocate=True)
    with pytest.raises(ValueError, match="loopback only"):
        SGLangConfig(model_path=str(tmp_path), device="cpu", host="10.0.0.2")
