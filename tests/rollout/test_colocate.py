"""The colocated protocol (``rollout/colocate.py``) against the real CPU SGLang server: drain, release, resume the
weights, the update through ``update_weights_from_tensor`` (bucketed tensor handles), resume the KV cache; after it
SGLang's log-probs equal the trainer's again (fp32: <= ``TOLERANCE`` per token, as ``test_weight_sync.py``).

What the CPU server does on release / resume: it runs without ``--enable-memory-saver`` (torch_memory_saver is
CUDA-only), so SGLang's no-op memory saver is in use: release drains and flushes the KV cache and stashes the
model's buffers, resume restores them, and no memory is freed. ``test_release_and_resume_keep_the_weights_on_cpu``
shows exactly that (the weights still serve the trainer's log-probs after a release and resume without a sync); it
claims nothing about memory. On GPUs (not run here) the released weights are gone until the next sync.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from gspo_megatron.rollout import SamplingParams, WeightSyncConfig, flatten, hf_weights, logprob_mismatch, samples_to_batch
from gspo_megatron.rollout.colocate import (KV_CACHE, WEIGHTS, Colocation, ColocationError, check_generating_allowed,
                                            pack, memory_tags)
from gspo_megatron.rollout.errors import RolloutError

from .helpers import TOLERANCE, fused_logprobs, prompts

SAMPLING = SamplingParams(max_new_tokens=12)


def _rollout(engine, seed):
    samples = flatten(engine.generate(prompts(8, seed=seed), n=4, sampling=SAMPLING))
    return samples, samples_to_batch(samples)


def _mismatch(model, batch):
    with torch.no_grad():
        return logprob_mismatch(fused_logprobs(model, batch), batch["rollout_logprobs"], batch["loss_mask"])


def _train_step(model, batch, lr=2e-2):
    """One policy-gradient step (random advantages): the weights move far enough that stale ones would show."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    advantages = torch.randn(batch["input_ids"].shape[0], generator=torch.Generator().manual_seed(1))
    lp = fused_logprobs(model, batch)
    mask = batch["loss_mask"].float()
    loss = -(advantages * (lp * mask).sum(-1) / mask.sum(-1)).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    model.eval()


def test_pack_places_every_tensor_in_one_byte_buffer():
    bucket = [("a", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b", torch.ones(4, dtype=torch.float32))]
    flat, buffer = pack(bucket, None, None)
    assert flat["flattened_tensor"].dtype == torch.uint8 and flat["flattened_tensor"].numel() == 40
    for (name, tensor), meta in zip(bucket, flat["metadata"]):
        part = flat["flattened_tensor"][meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)
        assert meta.name == name and torch.equal(part, tensor)
    again, reused = pack(bucket[1:], buffer, torch.bfloat16)  # a smaller bucket reuses the buffer, cast on packing
    assert reused is buffer and again["metadata"][0].dtype == torch.bfloat16 and again["metadata"][0].end_idx == 8
    assert memory_tags("cpu") == (KV_CACHE, WEIGHTS) and "cuda_graph" in memory_tags("cuda")


def test_release_and_resume_keep_the_weights_on_cpu(engine, trainer, record_property):
    """Release, resume (weights, then KV cache), generate: on CPU nothing was freed, so without any sync the server
    still serves the trainer's weights exactly."""
    colocation = Colocation(engine.worker_urls, "cpu", timeout_s=60, idle_timeout_s=30)
    colocation.release()
    assert colocation.released == (KV_CACHE, WEIGHTS)
    with pytest.raises(RolloutError, match="released to training"):
        check_generating_allowed(colocation)
    colocation.resume_weights()
    assert colocation.released == (KV_CACHE,)
    colocation.resume_kv_cache()
    assert colocation.released == ()
    check_generating_allowed(colocation)
    _, batch = _rollout(engine, seed=20)
    after = _mismatch(trainer.model, batch)
    record_property("colocate_release_resume", {**after, **colocation.metrics()})
    print(f"release + resume, no sync: max abs diff {after['mismatch/token_max_abs']:.3g}; {colocation.metrics()}")
    assert after["mismatch/token_max_abs"] <= TOLERANCE, after


def test_release_waits_for_idle_and_refuses_a_busy_server(engine):
    """SGLang asserts the server is idle inside release (its scheduler would die): a server still generating when
    the drain times out is refused before release is sent, and keeps serving."""
    sampling = SamplingParams(max_new_tokens=400, ignore_eos=True)
    started, outcome = threading.Event(), {}

    def generate():
        started.set()
        outcome["groups"] = engine.generate(prompts(4, seed=21), n=8, sampling=sampling)

    thread = threading.Thread(target=generate)
    thread.start()
    started.wait()
    colocation = Colocation(engine.worker_urls, "cpu", timeout_s=60, idle_timeout_s=0.2)
    try:
        deadline = time.monotonic() + 60
        while not any(engine._budget.in_flight.values()) and time.monotonic() < deadline:
            time.sleep(0.05)  # the requests are being sent
        time.sleep(1.0)  # and reach the server (400 tokens x 32 samples take several seconds there)
        with pytest.raises(ColocationError, match="not idle"):
            colocation.release()
        assert colocation.released == ()
    finally:
        thread.join(timeout=300)
    assert len(outcome["groups"]) == 4  # the rollout finished: the server was never released under it
    idle = Colocation(engine.worker_urls, "cpu", timeout_s=60, idle_timeout_s=30)
    idle.release()  # idle now: accepted
    idle.resume_weights()
    idle.resume_kv_cache()


@pytest.mark.parametrize("bucket_bytes", [16384, 256 << 20])
def test_colocated_update_matches_trainer(engine, trainer, record_property, monkeypatch, bucket_bytes):
    """The colocated step: rollout, release, train, resume weights, tensor sync (many 16 KiB buckets, one reused
    buffer; or one bucket), resume the KV cache, rollout: SGLang's log-probs equal the trainer's new ones."""
    monkeypatch.setattr(engine, "config", replace(engine.config, weight_sync=WeightSyncConfig(bucket_bytes=bucket_bytes)))
    colocation = Colocation(engine.worker_urls, "cpu", timeout_s=60, idle_timeout_s=30)
    _, batch = _rollout(engine, seed=22)
    before = _mismatch(trainer.model, batch)
    assert before["mismatch/token_max_abs"] <= TOLERANCE, before
    colocation.release()
    _train_step(trainer.model, batch)
    stale = _mismatch(trainer.model, batch)
    assert stale["mismatch/token_max_abs"] > 100 * TOLERANCE, stale
    colocation.resume_weights()
    version = f"colocated-{bucket_bytes}"
    stats = engine.update_weights(hf_weights.checkpoint_tensors(trainer.model), version, method="tensor")
    colocation.resume_kv_cache()
    sizes = [t.numel() * 4 for _, t in hf_weights.checkpoint_tensors(trainer.model)]
    assert stats.method == "tensor" and stats.weight_version == version == engine.weight_version()
    assert stats.num_tensors == len(sizes) and stats.num_bytes == sum(sizes)
    assert stats.num_buckets > 10 if bucket_bytes == 16384 else stats.num_buckets == 1
    samples, batch = _rollout(engine, seed=23)
    assert {s.weight_version for s in samples} == {version}
    after = _mismatch(trainer.model, batch)
    record_property(f"colocate_mismatch_after_{bucket_bytes}", after)
    print(f"tensor sync {stats.seconds:.3f} s in {stats.num_buckets} buckets; stale {stale['mismatch/token_max_abs']:.3g}"
          f" -> after {after['mismatch/token_max_abs']:.3g}")
    assert after["mismatch/token_max_abs"] <= TOLERANCE, after


def test_colocated_cuda_servers_start_with_the_memory_saver(tmp_path):
    """Without --enable-memory-saver a GPU server's release frees nothing; CPU servers cannot have it."""
    from gspo_megatron.rollout import SGLangConfig
    from gspo_megatron.rollout.server import launch_command

    gpu = launch_command(SGLangConfig(model_path=str(tmp_path), device="cuda", colocate=True), 30000, [0, 1])
    assert "--enable-memory-saver" in gpu
    assert "--enable-memory-saver" not in launch_command(SGLangConfig(model_path=str(tmp_path), device="cuda"), 1, [0])
    assert "--enable-memory-saver" not in launch_command(
        SGLangConfig(model_path=str(tmp_path), device="cpu", colocate=True), 1, [])
