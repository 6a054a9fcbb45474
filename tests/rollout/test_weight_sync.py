"""Weight sync into the real SGLang server: after a training update and a distributed (or disk) sync, SGLang's
log-probs equal the trainer's again (fp32: <= 1e-3 per token) and the server reports the new version."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.rollout import (SamplingParams, WeightSyncConfig, WeightSyncError, flatten, logprob_mismatch,
                                   samples_to_batch)
from gspo_megatron.rollout import hf_weights
from gspo_megatron.rollout.weight_sync import buckets

from .helpers import TOLERANCE, fused_logprobs, prompts

SAMPLING = SamplingParams(max_new_tokens=12)


def _rollout(engine, seed):
    samples = flatten(engine.generate(prompts(8, seed=seed), n=4, sampling=SAMPLING))
    return samples, samples_to_batch(samples)


def _train_step(model, batch, lr=2e-2):
    """One policy-gradient step through the fused op (random advantages): weights move enough that stale
    weights would show as a large log-prob gap."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    advantages = torch.randn(batch["input_ids"].shape[0], generator=torch.Generator().manual_seed(0))
    lp = fused_logprobs(model, batch)
    mask = batch["loss_mask"].float()
    loss = -(advantages * (lp * mask).sum(-1) / mask.sum(-1)).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    model.eval()


def _mismatch(model, batch):
    with torch.no_grad():
        return logprob_mismatch(fused_logprobs(model, batch), batch["rollout_logprobs"], batch["loss_mask"])


def _update_and_check(engine, trainer, method, version, record_property):
    _, batch = _rollout(engine, seed=10)
    before = _mismatch(trainer.model, batch)
    assert before["mismatch/token_max_abs"] <= TOLERANCE, before
    old = {n: t.clone() for n, t in hf_weights.checkpoint_tensors(trainer.model)}
    _train_step(trainer.model, batch)
    stale = _mismatch(trainer.model, batch)  # new trainer weights vs the old rollout: must differ clearly
    assert stale["mismatch/token_max_abs"] > 100 * TOLERANCE, stale
    stats = engine.update_weights(hf_weights.checkpoint_tensors(trainer.model), version, method=method)
    assert stats.method == method and stats.weight_version == version
    assert stats.num_tensors == len(old) and stats.num_bytes == sum(t.numel() * 4 for t in old.values())
    assert engine.weight_version() == version
    samples, batch = _rollout(engine, seed=11)
    assert {s.weight_version for s in samples} == {version}
    after = _mismatch(trainer.model, batch)
    record_property(f"mismatch_before_{method}", before)
    record_property(f"mismatch_after_{method}", after)
    print(f"{method} sync {stats.seconds:.3f} s; mismatch before {before} after {after}")
    assert after["mismatch/token_max_abs"] <= TOLERANCE, after
    return stats


def test_distributed_sync_after_update(engine, trainer, record_property):
    _update_and_check(engine, trainer, "distributed", "step-1", record_property)


def test_disk_sync_after_update(engine, trainer, record_property):
    _update_and_check(engine, trainer, "disk", "step-2", record_property)


@pytest.mark.parametrize("flatten", [True, False])
def test_distributed_sync_in_small_buckets(engine, trainer, record_property, monkeypatch, flatten):
    """16 KiB buckets: many buckets, each exported and packed (into alternating buffers when flattened) while the
    previous one is on the wire, and tensors larger than a bucket sent on their own."""
    sizes = [t.numel() * 4 for _, t in hf_weights.checkpoint_tensors(trainer.model)]
    assert max(sizes) > 16384 > min(sizes)
    sync = WeightSyncConfig(bucket_bytes=16384, flatten=flatten)
    monkeypatch.setattr(engine, "config", _with_sync(engine.config, sync))
    stats = _update_and_check(engine, trainer, "distributed", f"step-3-{flatten}", record_property)
    assert stats.num_buckets > 10
    assert 0 <= stats.phases["wait"] <= stats.phases["transfer"]
    assert stats.phases["overlap"] == pytest.approx(stats.phases["transfer"] - stats.phases["wait"])


def _with_sync(config, sync):
    from dataclasses import replace

    return replace(config, weight_sync=sync)


def test_same_version_twice_is_refused(engine, trainer):
    from gspo_megatron.rollout import WeightSyncError

    with pytest.raises(WeightSyncError, match="already served"):
        engine.update_weights(hf_weights.checkpoint_tensors(trainer.model), engine.weight_version())


def test_buckets_bound_bytes_and_keep_one_dtype():
    tensors = [("a", torch.zeros(100)), ("b", torch.zeros(100)), ("c", torch.zeros(300)),
               ("d", torch.zeros(10, dtype=torch.bfloat16)), ("e", torch.zeros(2000)), ("f", torch.zeros(1))]
    out = [[n for n, _ in b] for b in buckets(iter(tensors), bucket_bytes=1024)]
    # a+b = 800 B; c (1200 B) alone is larger than a bucket; d changes dtype; e (8000 B) alone; f.
    assert out == [["a", "b"], ["c"], ["d"], ["e"], ["f"]]
    # Cast to bf16 before sending: sizes count the sent dtype (a+b+c = 1000 B fit one bucket then).
    out = [[n for n, _ in b] for b in buckets(iter(tensors), bucket_bytes=1024, dtype=torch.bfloat16)]
    assert out == [["a", "b", "c", "d"], ["e"], ["f"]]
    # One dtype, as the bridge's export streams it: a tensor that would overflow a bucket starts the next one.
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]  # fp32: 4 bytes each
    groups = [[name for name, _ in bucket] for bucket in buckets(tensors, bucket_bytes=80)]
    assert groups == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]


def test_buckets_never_part_what_sglang_joins_on_load():
    """SGLang fuses q_a_proj with kv_a_proj_with_mqa only within one load_weights call (one bucket): the cut after
    q_a_proj is held, the bucket then exceeding its bytes; a dtype change there is refused by name."""
    layer = "model.layers.3.self_attn"
    tensors = [(f"{layer}.q_a_proj.weight", torch.zeros(300)), (f"{layer}.kv_a_proj_with_mqa.weight", torch.zeros(300)),
               (f"{layer}.q_a_layernorm.weight", torch.zeros(10))]
    out = [[n.rsplit(".", 2)[1] for n, _ in b] for b in buckets(tensors, bucket_bytes=1024)]
    assert out == [["q_a_proj", "kv_a_proj_with_mqa"], ["q_a_layernorm"]]
    tensors[1] = (tensors[1][0], torch.zeros(300, dtype=torch.bfloat16))
    with pytest.raises(WeightSyncError, match="q_a_proj.weight' and .*kv_a_proj_with_mqa.weight' must share a bucket"):
        list(buckets(tensors, bucket_bytes=1024))


def test_a_sender_on_another_host_is_reached_at_its_own_name():
    """``rollout.weight_sync_address`` names rank 0's host; a pipeline stage's sender elsewhere keeps its own name."""
    import socket

    from gspo_megatron.rollout.weight_sync import SyncTarget

    remote = ("http://10.0.0.5:30000",)
    here = SyncTarget(remote, (8,), WeightSyncConfig(master_address="10.0.0.1"), "nccl", host=socket.gethostname())
    assert here.address() == "10.0.0.1"
    elsewhere = SyncTarget(remote, (8,), WeightSyncConfig(master_address="10.0.0.1"), "nccl", host="rank0-node")
    assert elsewhere.address() == socket.getfqdn()
    local = SyncTarget(("http://127.0.0.1:30000",), (1,), WeightSyncConfig(), "gloo", host="rank0-node")
    assert local.address() == "127.0.0.1"
