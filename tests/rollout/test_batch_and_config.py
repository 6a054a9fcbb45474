"""Samples -> trainer tensors alignment, the mismatch metric, and configuration checks naming the field."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gspo_megatron.rollout import Sample, SamplingParams, SGLangConfig, WeightSyncConfig, logprob_mismatch
from gspo_megatron.rollout import samples_to_batch
from gspo_megatron.rollout.sglang_engine import (TokenBudget, parse_generate, request_chunks, request_tokens,
                                                 server_capacity, update_group_ranks)
from gspo_megatron.rollout.errors import BadResponse, RequestFailed, WeightSyncError


def test_samples_to_batch_aligns_logprobs_with_labels():
    a = Sample([5, 6, 7], [8, 9], [-0.5, -0.25], "length", "v", 0, 0)
    b = Sample([5], [4, 3, 2], [-1.0, -2.0, -3.0], "stop", "v", 0, 1)
    batch = samples_to_batch([a, b], pad_id=0, pad_to_multiple=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [5, 4, 3, 2, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[6, 7, 8, 9, 0, 0, 0, 0], [4, 3, 2, 0, 0, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[False, False, True, True] + [False] * 4,
                                           [True, True, True] + [False] * 5]
    assert batch["rollout_logprobs"][0, 2:4].tolist() == [-0.5, -0.25]
    assert batch["rollout_logprobs"][1, :3].tolist() == [-1.0, -2.0, -3.0]
    # Every response token is a label exactly where the mask is set.
    assert batch["labels"][batch["loss_mask"]].tolist() == [8, 9, 4, 3, 2]


def test_mismatch_metric():
    mask = torch.tensor([[True, True, False]])
    rollout = torch.tensor([[-1.0, -2.0, 0.0]])
    same = logprob_mismatch(rollout.clone(), rollout, mask)
    assert all(v == 0.0 for v in same.values())
    shifted = logprob_mismatch(rollout + torch.tensor([[0.1, -0.3, 5.0]]), rollout, mask)
    assert shifted["mismatch/token_max_abs"] == pytest.approx(0.3)
    assert shifted["mismatch/token_mean_abs"] == pytest.approx(0.2)
    assert shifted["mismatch/seq_log_ratio_max_abs"] == pytest.approx(0.1)
    assert shifted["mismatch/kl_k3"] > 0


def _item(prompt_len, ids, finish="length"):
    return {"output_ids": ids, "text": "", "meta_info": {
        "prompt_tokens": prompt_len, "finish_reason": {"type": finish}, "weight_version": "v",
        "output_token_logprobs": [[-1.0, t, None] for t in ids]}}


def test_parse_generate_is_prompt_major_and_checked():
    prompts = [[1, 2], [3, 4, 5]]
    answer = [_item(2, [7]), _item(2, [8]), _item(3, [9]), _item(3, [10])]
    samples = parse_generate(answer, prompts, 2, 0, "u")
    assert [(s.prompt_index, s.sample_index, s.response_ids) for s in samples] == [
        (0, 0, [7]), (0, 1, [8]), (1, 0, [9]), (1, 1, [10])]
    with pytest.raises(BadResponse, match="returned 3 samples for 2 prompts x n=2"):
        parse_generate(answer[:3], prompts, 2, 0, "u")
    with pytest.raises(BadResponse, match="prompt-major order did not hold"):
        parse_generate([answer[0], answer[2], answer[1], answer[3]], prompts, 2, 0, "u")
    with pytest.raises(BadResponse, match="prompt 1, sample 1: finished with .*abort"):
        parse_generate(answer[:3] + [_item(3, [10], "abort")], prompts, 2, 0, "u")


@pytest.mark.parametrize("kwargs, match", [
    (dict(device="tpu"), "sglang.device='tpu'"),
    (dict(model_path=""), "sglang.model_path is required"),
    (dict(model_path="/no/such/dir"), "is not a directory"),
    (dict(router_url="http://127.0.0.1:1"), "router_url needs sglang.urls"),
    (dict(tp_size=2), "sglang.tp_size=2 on CPU"),
    (dict(concurrency=0), "sglang.concurrency=0 must be >= 1"),
    (dict(request_timeout_s=0), "sglang.request_timeout_s=0 must be > 0"),
    (dict(host="0.0.0.0"), "loopback only"),
    (dict(extra_args=("--pp-size", "2")), "sglang.extra_args sets a pipeline-parallel size of 2"),
    (dict(extra_args=("--pipeline-parallel-size=4",)), "sglang.extra_args sets a pipeline-parallel size of 4"),
])
def test_config_errors_name_the_field(tmp_path, kwargs, match):
    base = dict(model_path=str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match=match):
        SGLangConfig(**{**base, **kwargs})


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="nfs"), "weight_sync.method='nfs'"),
    (dict(bucket_bytes=10), "weight_sync.bucket_bytes=10"),
    (dict(dtype="bf16"), "weight_sync.dtype='bf16'"),
])
def test_weight_sync_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WeightSyncConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=0.0), "sampling.temperature=0.0"),
    (dict(top_p=0.0), "sampling.top_p=0.0"),
    (dict(top_k=0), "sampling.top_k=0"),
    (dict(max_new_tokens=0), "sampling.max_new_tokens=0"),
])
def test_sampling_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_update_group_ranks_count_as_sglang_does():
    # SGLang 0.5.23: rank = rank_offset + tp_rank in every pipeline stage (weight_updater.init_weights_update_group)
    assert update_group_ranks("u", {"tp_size": 4, "pp_size": 1}) == 4
    assert update_group_ranks("u", {"tp_size": 2}) == 2
    with pytest.raises(WeightSyncError, match="u serves with pp_size=2: .*weight_sync.method=disk"):
        update_group_ranks("u", {"tp_size": 4, "pp_size": 2})
    SGLangConfig(model_path="m", urls=("http://127.0.0.1:1",), extra_args=("--pp-size", "1"))  # pp 1: allowed


def test_gpu_groups():
    config = SGLangConfig(urls=("http://127.0.0.1:1",), device="cuda", num_servers=2, tp_size=2, first_gpu=4)
    assert config.gpu_groups == [[4, 5], [6, 7]] and config.sync_backend == "nccl"


def test_trainer_address_for_the_weight_broadcast(monkeypatch):
    from gspo_megatron.rollout import WeightSyncConfig
    from gspo_megatron.rollout.weight_sync import trainer_address

    local = ["http://127.0.0.1:30000", "http://localhost:30001"]
    assert trainer_address(local, WeightSyncConfig()) == "127.0.0.1"
    monkeypatch.setattr("socket.getfqdn", lambda: "trainer-0.cluster")
    # A server on another node cannot join a group at loopback: it gets this host's name, or the configured one.
    assert trainer_address([*local, "http://10.0.0.7:30000"], WeightSyncConfig()) == "trainer-0.cluster"
    assert trainer_address(local, WeightSyncConfig(master_address="10.0.0.1")) == "10.0.0.1"


def test_launched_servers_do_not_inherit_the_trainers_torchrun_env(monkeypatch, tmp_path):
    from gspo_megatron.rollout import SGLangConfig
    from gspo_megatron.rollout.server import server_env

    for key, value in {"RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": "29500", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("GSPO_UNRELATED", "kept")
    env = server_env(SGLangConfig(model_path=str(tmp_path), device="cpu", cpu_threads=1), [])
    assert not {"RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"} & env.keys()
    assert env["GSPO_UNRELATED"] == "kept" and env["OMP_NUM_THREADS"] == "1"


def test_launched_servers_of_a_gated_deltanet_hybrid_get_what_sglang_needs(tmp_path):
    """A Qwen3.5 directory as transformers saves it (``layer_types``, no ``full_attention_interval``): the servers
    load a copy of links with the field added (the user's directory untouched), and on CPU run without the radix
    cache (SGLang snapshots DeltaNet states per prefix only on GPUs); fp32 servers keep the convolution states in
    fp32. A Qwen3-MoE directory is served as it is, with the radix cache."""
    import json

    from gspo_megatron.rewards.synthetic import tiny_config
    from gspo_megatron.rollout.server import launch_command, server_env, serving_model_dir

    def saved_dir(name, family):  # config.json as transformers writes it, beside a weights file
        tiny_config(family).save_pretrained(tmp_path / name)
        (tmp_path / name / "model.safetensors").write_bytes(b"weights")
        return tmp_path / name

    hybrid = saved_dir("hybrid", "qwen3_5_moe")
    saved = (hybrid / "config.json").read_text()
    config = SGLangConfig(model_path=str(hybrid), device="cpu", dtype="float32")
    served = Path(serving_model_dir(config, tmp_path / "logs"))
    assert served == tmp_path / "logs" / "serving_model" and (hybrid / "config.json").read_text() == saved
    assert json.loads((served / "config.json").read_text()) == {**json.loads(saved), "full_attention_interval": 2}
    assert (served / "model.safetensors").resolve() == (hybrid / "model.safetensors").resolve()
    assert serving_model_dir(config, tmp_path / "logs") == str(served)  # kept for the next start
    assert "--disable-radix-cache" in launch_command(replace(config, model_path=str(served)), 1, [])
    assert launch_command(replace(config, device="cuda"), 1, [0]).count("--disable-radix-cache") == 0
    assert server_env(config, [])["SGLANG_MAMBA_CONV_DTYPE"] == "float32"
    assert "SGLANG_MAMBA_CONV_DTYPE" not in server_env(replace(config, dtype="bfloat16"), [])
    plain = SGLangConfig(model_path=str(saved_dir("plain", "qwen3_moe")), device="cpu")
    assert serving_model_dir(plain, tmp_path / "logs2") == plain.model_path
    assert "--disable-radix-cache" not in launch_command(plain, 1, [])


def test_server_capacity_from_server_info():
    # SGLang 0.5.23's /server_info: max_total_num_tokens (the first scheduler's) and, per data-parallel scheduler,
    # internal_states[i].memory_usage.token_capacity
    assert server_capacity({"max_total_num_tokens": 1024}) == 1024
    dp2 = {"max_total_num_tokens": 500, "internal_states": [{"memory_usage": {"token_capacity": 500}}] * 2}
    assert server_capacity(dp2) == 1000
    assert server_capacity({}) is None


def test_requests_are_sized_to_the_kv_cache():
    prompts = [[1] * 10, [1] * 20, [1] * 10, [1] * 60]
    assert request_tokens(prompts[:2], n=4, max_new_tokens=30) == 4 * 40 + 4 * 50
    # 4 samples x (prompt + 30): 160, 200, 160, 360 tokens; a cache of 400 holds the first two, then one each
    chunks = request_chunks(prompts, n=4, max_new_tokens=30, most=8, capacity=400)
    assert [(start, len(chunk)) for start, chunk in chunks] == [(0, 2), (2, 1), (3, 1)]
    assert [len(c) for _, c in request_chunks(prompts, 4, 30, most=3, capacity=None)] == [3, 1]  # unknown: count
    assert [len(c) for _, c in request_chunks(prompts, 4, 30, most=8, capacity=100)] == [1, 1, 1, 1]  # each too big


def test_token_budget_admits_what_fits_and_times_out_per_wave():
    import threading

    budget = TokenBudget({"a": 1000, "b": 1000})
    never = threading.Event()
    assert budget.acquire(600, never) == ("a", 1)
    assert budget.acquire(600, never) == ("b", 1)  # the emptier server
    assert budget.acquire(300, never) == ("a", 1)  # 900 <= 1000
    got = []
    waiter = threading.Thread(target=lambda: got.append(budget.acquire(500, never)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not got  # fits nowhere: waits
    budget.release("b", 600)
    waiter.join(5)
    assert got == [("b", 1)] and budget.peak == {"a": 900, "b": 600}
    # a request larger than the whole cache goes alone, its time-out covering its waves
    assert TokenBudget({"a": 1000}).acquire(2500, never) == ("a", 3)
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(RequestFailed, match="waiting for KV-cache room"):
        budget.acquire(2000, cancelled)
