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


def test_buckets_bound_bytes_and_align_each_dtype():
    tensors = [("a", torch.zeros(100)), ("b", torch.zeros(100)), ("c", torch.zeros(300)),
               ("d", torch.zeros(10, dtype=torch.bfloat16)), ("e", torch.zeros(2000)), ("f", torch.zeros(1))]
    out = [[n for n, _ in b] for b in buckets(iter(tensors), bucket_bytes=1024)]
    # a+b = 800 B; c (1200 B) alone is larger than a bucket; d (20 B) after it would overflow; e (8000 B) alone; f.
    assert out == [["a", "b"], ["c"], ["d"], ["e"], ["f"]]
    # Cast to bf16 before sending: sizes count the sent dtype (a+b+c+d = 1020 B fit one bucket then).
    out = [[n for n, _ in b] for b in buckets(iter(tensors), bucket_bytes=1024, dtype=torch.bfloat16)]
    assert out == [["a", "b", "c", "d"], ["e"], ["f"]]
    # A tensor that would overflow a bucket starts the next one.
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]  # fp32: 4 bytes each
    groups = [[name for name, _ in bucket] for bucket in buckets(tensors, bucket_bytes=80)]
    assert groups == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    # Dtypes mix where each tensor sits at a multiple of its size (SGLang's flattened bucket refuses others):
    # fp32 after 2 bf16 values (4 B) joins, after 3 (6 B) starts the next bucket.
    bf16 = lambda n: torch.zeros(n, dtype=torch.bfloat16)  # noqa: E731
    tensors = [("x", bf16(2)), ("y", torch.zeros(2)), ("z", bf16(3)), ("w", torch.zeros(2))]
    assert [[n for n, _ in b] for b in buckets(tensors, bucket_bytes=1024)] == [["x", "y", "z"], ["w"]]


BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def test_a_bf16_sync_sends_the_router_bias_in_fp32_bit_for_bit(tmp_path):
    """SGLang's DeepSeek / GLM-4.5 gates keep ``e_score_correction_bias`` fp32, as megatron does (mapping.KEPT_FP32):
    a bf16 sync sends it as the trainer holds it, the other weights in bf16, in one mixed bucket, by every path
    (the distributed sender's flattened and per-tensor packing, the colocated pack, the disk shards). The bias sits
    at 100 with a spread of a few bf16 steps (0.5 there), as GLM-5's does: rounded, it would reorder the routing."""
    from safetensors.torch import load_file

    from gspo_megatron.rollout.colocate import pack
    from gspo_megatron.rollout.weight_sync import DistributedSender, save_checkpoint
    from tests.model.hf_tiny import same_bits

    g = torch.Generator().manual_seed(0)
    bias = 100 + torch.randn(8, generator=g)
    assert not torch.equal(bias.bfloat16().float(), bias)
    tensors = [("model.layers.1.mlp.gate.weight", torch.randn(8, 4, generator=g)), (BIAS, bias),
               ("model.layers.1.mlp.experts.0.up_proj.weight", torch.randn(3, 4, generator=g))]
    (bucket,) = buckets(tensors, bucket_bytes=4096, dtype=torch.bfloat16)  # 64 + 32 + 24 bytes
    sent = {}
    for flat in (True, False):
        sender = object.__new__(DistributedSender)  # the packing alone: no group, no server
        sender.device = torch.device("cpu")
        sender._configure(WeightSyncConfig(bucket_bytes=4096, dtype="bfloat16", flatten=flat))
        packed = sender._pack(bucket, 0)
        assert packed.dtypes == ["bfloat16", "float32", "bfloat16"] and packed.num_bytes == 120
        if flat:  # read back as SGLang's FlattenedTensorBucket.empty lays it out: back to back, each aligned
            offsets = torch.tensor([0, 64, 96, 120])
            sent["flattened"] = {n: packed.payload[0][a:b].view(getattr(torch, d)).reshape(s) for n, d, s, a, b in
                                 zip(packed.names, packed.dtypes, packed.shapes, offsets[:-1], offsets[1:])}
        else:
            sent["per tensor"] = dict(zip(packed.names, packed.payload))
    flat, _ = pack(bucket, None, torch.bfloat16)
    sent["colocated"] = {m.name: flat["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)
                         for m in flat["metadata"]}
    save_checkpoint(tensors, tmp_path, tmp_path, 4096, torch.bfloat16)
    sent["disk"] = load_file(tmp_path / "model-00001.safetensors")
    for path, got in sent.items():
        assert same_bits(got[BIAS], bias), path
        assert all(same_bits(got[n], t.bfloat16()) for n, t in tensors if n != BIAS), path


def test_buckets_never_part_what_sglang_joins_on_load():
    """SGLang fuses q_a_proj with kv_a_proj_with_mqa only within one load_weights call (one bucket): the cut after
    q_a_proj is held, the bucket then exceeding its bytes; a second one that would sit unaligned is refused by name."""
    layer = "model.layers.3.self_attn"
    tensors = [(f"{layer}.q_a_proj.weight", torch.zeros(300)), (f"{layer}.kv_a_proj_with_mqa.weight", torch.zeros(300)),
               (f"{layer}.q_a_layernorm.weight", torch.zeros(10))]
    out = [[n.rsplit(".", 2)[1] for n, _ in b] for b in buckets(tensors, bucket_bytes=1024)]
    assert out == [["q_a_proj", "kv_a_proj_with_mqa"], ["q_a_layernorm"]]
    tensors[0] = (tensors[0][0], torch.zeros(301, dtype=torch.bfloat16))  # 602 bytes: fp32 cannot follow
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
