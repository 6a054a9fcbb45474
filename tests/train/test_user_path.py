"""The path a user walks after a first run, end to end through the command line: a training checkpoint (written at
EP2 by ``torchrun ... gspo-megatron train``) -> ``tools/convert_megatron_to_hf.py`` at world 1 -> transformers loads
it -> ``gspo-megatron score`` on the checkpoint (the trainer's own log-prob pass) -> the real SGLang server serves the
converted directory -> a new run starts from the checkpoint's weights (``model.megatron_checkpoint``) at world 1.
One chained test: each step feeds the next, and the training run is the session's shared ``uninterrupted_two_ranks``.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests import warm_cli
from tests.train.torchrun_runs import ROOT, env

# fp32 everywhere: trainer, transformers and SGLang agree to ~1e-6 per token (README); sums over <= 8 tokens
TOKEN_TOL = 1e-4
SUM_TOL = 1e-4


def _run(*args, timeout=600):
    out = warm_cli.run([sys.executable, *args], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{args[:2]} failed:\n{out.stderr[-3000:]}"
    return out


def _score(model, records_file, out_file) -> list[float]:
    _run("-m", "gspo_megatron.cli", "score", "--model", str(model), "--input", str(records_file),
         "--output", str(out_file))
    return [json.loads(line)["logprob_sum"] for line in out_file.read_text().splitlines()]


def _transformers_logprobs(hf_dir, samples) -> list[torch.Tensor]:
    """Per response token, log p under transformers' model of ``hf_dir`` (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logprobs = torch.log_softmax(model(ids[:, :-1]).logits.float(), -1).gather(-1, ids[:, 1:, None])[0, :, 0]
            out.append(logprobs[len(s.prompt_ids) - 1:])
    return out


@pytest.fixture(scope="session")
def sglang_installed():
    """Skips (fails under CI=true) without SGLang, before the session's training run is paid for: session-scoped
    fixtures are set up first, in argument order."""
    from tests.rollout.helpers import require_sglang

    require_sglang()


@pytest.mark.megatron
def test_a_training_checkpoint_converts_scores_serves_and_starts_a_new_run(sglang_installed, uninterrupted_two_ranks,
                                                                           tmp_path):
    from gspo_megatron.model import checkpoint
    from gspo_megatron.rollout import SamplingParams, SGLangConfig, SGLangEngine, flatten
    from gspo_megatron.rollout import server as server_mod

    run, model = uninterrupted_two_ranks
    ck = run / "ck"
    # checkpoint.dir, its latest and its newest step dir all mean the same checkpoint
    newest = ck / (ck / "latest").read_text().strip()
    assert checkpoint.resolve(ck) == checkpoint.resolve(ck / "latest") == checkpoint.resolve(newest) == newest
    assert checkpoint.read_info(ck).saved_layout["expert"] == 2

    # 1. the step dir -> HF at world 1 (the EP2 shards resharded by dist checkpointing)
    hf = tmp_path / "hf"
    out = _run("tools/convert_megatron_to_hf.py", "--megatron-dir", str(newest), "--out", str(hf))
    assert "Warning" not in out.stderr, out.stderr

    # 2. the real SGLang server serves the converted directory (fp32); its samples are the records scored below. It
    # starts while step 3 runs (its start-up is the slowest part).
    config = SGLangConfig(model_path=str(hf), device="cpu", dtype="float32", max_total_tokens=4096,
                          max_running_requests=16, context_length=256, log_dir=str(tmp_path / "sglang"),
                          startup_timeout_s=600, request_timeout_s=120, rollout_timeout_s=180, cpu_threads=1)
    servers = server_mod.start_servers(config)
    try:
        # 3. a new run from the checkpoint's weights (latest), at world 1, lr 0: its rollouts come from those weights
        # (the engine synced to them: rollout-vs-trainer gap ~1e-6); its own checkpoint is scored in step 5
        new_run = tmp_path / "new_run"
        out = _run("-m", "gspo_megatron.cli", "train", "examples/tiny_moe_cpu.yaml", "train.steps=1",
                   "train.eval_every=0", f"model.hf_dir={model}", f"model.megatron_checkpoint={ck / 'latest'}",
                   f"logging.dir={new_run}", f"checkpoint.dir={new_run / 'ck'}", "logging.plot_every=0",
                   "rollout.prompts_per_step=2", "parallel.micro_batch_size=4", "rollout.engine=local",
                   "data.reward_workers=0", "optimizer.lr=0")
        # quiet: our one line and the progress bar, no third-party warnings or loading bars (a dist checkpoint read)
        noise = [line for line in out.stderr.splitlines() if "Warning" in line or "Loading weights" in line]
        assert not noise, noise
        metrics = json.loads((new_run / "metrics.jsonl").read_text().splitlines()[0])
        assert metrics["logprob_diff_max"] <= TOKEN_TOL, metrics["logprob_diff_max"]

        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 120, (n,), generator=g).tolist() for n in (3, 5, 7, 9)]
        with SGLangEngine(config, servers=servers) as engine:
            samples = flatten(engine.generate(prompts, n=2, sampling=SamplingParams(max_new_tokens=8, seed=1)))
    finally:
        for server in servers:
            server.shutdown()
    records = tmp_path / "records.jsonl"
    records.write_text("".join(json.dumps({"prompt_ids": s.prompt_ids, "response_ids": s.response_ids}) + "\n"
                               for s in samples))

    # 4. transformers on the converted directory, per token, against SGLang's
    ours = _transformers_logprobs(hf, samples)
    gap = max(float((lp - torch.tensor(s.logprobs)).abs().max()) for lp, s in zip(ours, samples))
    assert gap <= TOKEN_TOL, f"transformers vs SGLang on the converted model: {gap:.3g} per token"

    # 5. score on the checkpoint (given as checkpoint.dir: its latest) = the trainer's log-prob pass, at world 1
    scored = _score(ck, records, tmp_path / "scored.jsonl")
    sums = [float(lp.sum()) for lp in ours]
    assert max(abs(a - b) for a, b in zip(scored, sums)) <= SUM_TOL, (scored, sums)
    # the training changed the weights: the starting model disagrees (so the comparisons above could fail)
    start = _transformers_logprobs(model, samples)
    assert max(float((a - b).abs().max()) for a, b in zip(start, ours)) > 1e-3

    # the new run's checkpoint (lr 0) scores as the one it started from
    rescored = _score(new_run / "ck", records, tmp_path / "rescored.jsonl")
    assert max(abs(a - b) for a, b in zip(rescored, scored)) <= 1e-6, (rescored, scored)
