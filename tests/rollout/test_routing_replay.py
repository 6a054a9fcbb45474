"""Rollout routing replay (R3, ``algo.routing_replay: rollout``) against the real SGLang server.

The server (started with --enable-return-routed-experts) returns, per sample, the experts it routed each token
of prompt + response but the last to: [P + R - 1, layers, top-k]. Replayed in the Megatron policy under TP=2 with
sequence parallelism (2 gloo ranks), every router uses exactly the server's experts for every token the server
routed, and the policy's log-probs equal SGLang's (fp32: <= TOLERANCE per token). The same routes shifted by one
position (a misaligned replay) move the log-probs far off: the replay is in effect and its alignment matters.
Free routing is reported beside them (fp32 on both sides: it mostly routes like the server already).
A short training run (world=1) with ``algo.routing_replay=rollout`` against the same server logs its metrics,
its old-policy pass (under the replay) agreeing with SGLang. Without a server: the decoding and batching checks.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.rollout import Sample, hf_weights, samples_to_batch
from gspo_megatron.rollout.errors import BadResponse
from gspo_megatron.rollout.sglang_engine import parse_generate
from gspo_megatron.rollout.weight_sync import save_checkpoint
from tests import warm_cli

from .helpers import TOLERANCE
from .r3_ranks import GROUP, N_PROMPTS, r3_replay

ROOT = Path(__file__).resolve().parents[2]


def _answer(prompt_len: int, output: list[int], routes: np.ndarray | None) -> dict:
    meta = {"finish_reason": {"type": "length"}, "prompt_tokens": prompt_len, "weight_version": "0",
            "output_token_logprobs": [[-1.0, t, None] for t in output]}
    if routes is not None:
        meta["routed_experts"] = base64.b64encode(routes.astype(np.int32).tobytes()).decode()
    return {"output_ids": output, "meta_info": meta}


def test_routes_decode_align_and_fail_by_name():
    """Decoding (int32 [P + R - 1, L, k]), the batch's alignment (row t = input position t; the last token and the
    padding get experts 0..k-1) and the errors naming the sample: no routes, a length off by one."""
    prompt, output = [5, 6, 7], [8, 9]
    routes = np.arange(4 * 2 * 2).reshape(4, 2, 2) % 4
    (sample,) = parse_generate(_answer(3, output, routes), [prompt], 1, 0, "srv", routed_shape=(2, 2))
    assert sample.rollout_routing.dtype == torch.int16 and sample.rollout_routing.tolist() == routes.tolist()
    batch = samples_to_batch([sample], min_length=7)
    r = batch["rollout_routing"]
    assert r.shape == (1, 7, 2, 2) and r[0, :4].tolist() == routes.tolist()
    assert r[0, 4:].tolist() == [[[0, 1], [0, 1]]] * 3
    with pytest.raises(BadResponse, match=r"srv: prompt 0, sample 0: the answer has no routed_experts: start the "
                                          r"server with --enable-return-routed-experts"):
        parse_generate(_answer(3, output, None), [prompt], 1, 0, "srv", routed_shape=(2, 2))
    with pytest.raises(BadResponse, match=r"srv: prompt 0, sample 0: routed_experts holds 20 expert ids, expected 4 "
                                          r"tokens \(prompt \+ response - 1\) x 2 layers x top-2 = 16"):
        parse_generate(_answer(3, output, np.zeros((5, 2, 2))), [prompt], 1, 0, "srv", routed_shape=(2, 2))
    with pytest.raises(ValueError, match=r"sample \(prompt 0, sample 1\): rollout_routing of shape \(5, 2, 2\), "
                                         r"expected \[4, layers, top-k\]"):
        Sample(prompt, output, [-1.0, -1.0], "length", "0", 0, 1, rollout_routing=torch.zeros(5, 2, 2))
    with pytest.raises(ValueError, match=r"missing for \['prompt 0, sample 1'\]"):
        samples_to_batch([sample, Sample(prompt, output, [-1.0, -1.0], "length", "0", 0, 1)])


@pytest.mark.megatron  # builds a Megatron model
def test_replayed_routing_and_logprobs_equal_the_servers_tp2(engine, trainer, tiny_model_dir, tmp_path,
                                                              record_property):
    current = tmp_path / "current"  # the weights the server serves now (other tests may have synced some)
    save_checkpoint(hf_weights.checkpoint_tensors(trainer.model), current, tiny_model_dir, shard_bytes=1 << 30)
    layout = Layout(tensor=2, sequence_parallel=True)
    results = run_on_ranks(r3_replay, 2, layout, str(current), engine.worker_urls[0], layout, timeout=300)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    layers, topk = config["num_hidden_layers"], config["num_experts_per_tok"]
    shapes = results[0]["shapes"]
    assert len(shapes) == N_PROMPTS * GROUP and results[0]["distinct"]
    assert all(shape == (p + r - 1, layers, topk) for p, r, shape in shapes), shapes
    for rank, r in enumerate(results):
        print(f"rank {rank}: " + "  ".join(f"{k}: {r[k]}" for k in ("r3", "shifted", "free")))
        record_property(f"rank{rank}", {k: r[k] for k in ("r3", "shifted", "free")})
        r3, shifted = r["r3"], r["shifted"]
        assert r3["layers_seen"] == list(range(layers))
        assert r3["routes_total"] > 0 and r3["routes_same"] == r3["routes_total"], r3  # every route the server's
        assert r3["mismatch/token_max_abs"] <= TOLERANCE, r3
        assert shifted["routes_same"] < r3["routes_total"], shifted
        assert shifted["mismatch/token_max_abs"] > 100 * TOLERANCE, shifted  # replay is in effect, alignment counts


@pytest.mark.megatron  # builds a Megatron model
def test_multiturn_trajectory_routes_replayed_equal_the_servers(engine, trainer, tiny_model_dir, tmp_path):
    """3-turn trajectories (observations between the turns): the routes assembled from each turn's call, replayed at
    world=1, make every router use the server's experts, and the model tokens' log-probs equal SGLang's."""
    current = tmp_path / "current"
    save_checkpoint(hf_weights.checkpoint_tensors(trainer.model), current, tiny_model_dir, shard_bytes=1 << 30)
    (r,) = run_on_ranks(r3_replay, 1, Layout(), str(current), engine.worker_urls[0], Layout(), True, timeout=300)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert all(shape == (p + n - 1, config["num_hidden_layers"], config["num_experts_per_tok"])
               for p, n, shape in r["shapes"]), r["shapes"]
    print("multi-turn: " + "  ".join(f"{k}: {r[k]}" for k in ("r3", "shifted", "free")))
    assert r["r3"]["routes_total"] > 0 and r["r3"]["routes_same"] == r["r3"]["routes_total"], r["r3"]
    assert r["r3"]["mismatch/token_max_abs"] <= TOLERANCE, r["r3"]
    assert r["shifted"]["mismatch/token_max_abs"] > 100 * TOLERANCE, r["shifted"]


@pytest.mark.megatron  # trains the Megatron policy through the CLI
def test_training_with_rollout_routing_replay_logs_metrics(engine, trainer, tiny_model_dir, tmp_path):
    """Two GRPO steps with algo.routing_replay=rollout (world=1) attached to the server by URL: the loop asks for
    the routes, replays them in the old-policy pass (which then agrees with SGLang) and the update, and logs."""
    model = tmp_path / "model"
    save_checkpoint(hf_weights.checkpoint_tensors(trainer.model), model, tiny_model_dir, shard_bytes=1 << 30)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
           f"model.hf_dir={model}", f"rollout.urls=[{engine.worker_urls[0]}]", "algo.name=grpo",
           "algo.routing_replay=rollout", "train.steps=2", "train.eval_every=0", "rollout.prompts_per_step=4",
           "rollout.group_size=4", "parallel.micro_batch_size=8", "algo.minibatches=2", f"logging.dir={run}",
           "checkpoint.dir=", "logging.plot_every=0", "logging.tensorboard=false"]
    try:
        out = warm_cli.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env=dict(os.environ, WORLD_SIZE="1", PYTHONPATH=str(ROOT)))
    finally:  # the loop synced its weights to the server: put the session trainer's back for the tests that follow
        engine.update_weights(hf_weights.checkpoint_tensors(trainer.model), "restored-after-r3-loop")
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    print(records)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert all(np.isfinite(r[k]) for k in ("loss", "grad_norm", "reward_mean"))
        assert r["logprob_diff_max"] <= TOLERANCE, r  # the old-policy pass under the server's routing
