"""Our GLM-5 (``glm_moe_dsa``) and DeepSeek-V3.2 (``deepseek_v32``) tensors are what SGLang's ``GlmMoeDsaForCausalLM``
and ``DeepseekV32ForCausalLM`` load, checked against its own code, in-process (``sglang_load``, as
``test_deepseek_sglang_names`` does for DeepSeek-V3, whose loader both classes inherit): conversion's export (hf ->
Megatron -> ``megatron_to_hf`` at world 1, read by SGLang's safetensors iterator) and the weight sync's stream
(``Bridge.export_to_sender``, one tensor a bucket unless held, one ``load_weights`` call each), each loaded into a
model whose every parameter was first set to NaN. Every SGLang parameter must be written whole and equal ours through
DeepSeek's fusions (``test_deepseek_sglang_names.expected_params``), the lightning indexer's ``wq_b`` / ``wk`` /
``k_norm`` (a LayerNorm: weight and bias) as they are; its ``weights_proj`` SGLang holds in bf16 whatever the model's
dtype (``params_dtype=torch.bfloat16``, ``dsa_indexer.py``): it must hold ours rounded to bf16 (on CUDA SGLang fuses
``wk`` and ``weights_proj`` into one bf16 ``wk_weights_proj``, from the same two names: that branch does not run
here). The router bias its top-k routes with and MLA's ``w_kc`` / ``w_vc`` equal ours.

Two interpreters: DeepSeek sparse attention needs megatron-core 0.19.2 (``.venv312``, which has no SGLang), SGLang is
this one's. The Megatron side (conversion, the policy's stream) runs as this module's ``__main__`` under ``.venv312``
(or this interpreter where its megatron-core has DSA), SGLang's builds in ``sglang_load`` under this one: one process
each, both variants in it. On the CPU, ``sglang_load`` answers the CUDA capability query SGLang's server-args hook
makes for DSA models.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.model import hf_tiny

from .helpers import require_sglang
from .test_deepseek_sglang_names import _convert_and_stream, assert_loaded_equal, expected_params

REPO = Path(__file__).resolve().parents[2]
VENV312 = Path(os.environ.get("VENV312", REPO / ".venv312"))  # as tests/test_megatron_019.py
SEED = 21
BF16_IN_SGLANG = ".self_attn.indexer.weights_proj.weight"
# the architecture each tiny's config names, which SGLang builds: both DeepseekV2ForCausalLM's loader
SGLANG_CLASS = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}


def _policy_python() -> str:
    """An interpreter whose megatron-core builds DeepSeek sparse attention: this one, else ``.venv312``'s."""
    from gspo_megatron.model.dsa import megatron_has_dsa

    if megatron_has_dsa():
        return sys.executable
    python = VENV312 / "bin" / "python"
    if not python.exists():
        pytest.skip(f"GLM-5 needs megatron-core 0.19 and {VENV312} is missing: `bash tools/install.sh` builds it")
    return str(python)


def export_and_stream(*dirs: str) -> None:
    """Per (hf_dir, work) pair: conversion's export to ``work/export`` and the policy's weight-sync stream to
    ``work/stream.pt``, every variant on the same one rank (run by ``__main__``, under the interpreter
    ``_policy_python`` picks)."""
    from gspo_megatron.parallel.groups import Layout
    from gspo_megatron.parallel.launch import run_on_ranks

    pairs = list(zip(dirs[::2], dirs[1::2], strict=True))
    (streams,) = run_on_ranks(_convert_and_stream, 1, Layout(),
                              [(hf_dir, f"{work}/megatron", f"{work}/export") for hf_dir, work in pairs], timeout=300)
    for (_, work), stream in zip(pairs, streams, strict=True):
        torch.save(stream, f"{work}/stream.pt")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Per variant: its export's config, its stream, the export's tensors and SGLang's loads of both; both variants
    through one policy process and one SGLang process."""
    require_sglang()
    from gspo_megatron.model.hf_files import SafetensorsDir
    from gspo_megatron.rollout.server import node_env
    from gspo_megatron.rollout.weight_sync import buckets

    python = _policy_python()
    root = tmp_path_factory.mktemp("dsa")
    works = {variant: root / variant for variant in SGLANG_CLASS}
    hf_dirs = {variant: hf_tiny.save_variant(variant, work, seed=SEED) for variant, work in works.items()}
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | {"PYTHONPATH": str(REPO)}
    run = subprocess.run([python, "-m", "tests.rollout.test_glm5_sglang_names",
                          *(str(p) for v in works for p in (hf_dirs[v], works[v]))], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    streams = {v: torch.load(work / "stream.pt", weights_only=False) for v, work in works.items()}
    for variant, work in works.items():
        loads = {"export": ["files"], "sync": list(buckets(streams[variant], bucket_bytes=1))}
        torch.save(loads, work / "loads.pt")
    run = subprocess.run([sys.executable, "-m", "tests.rollout.sglang_load",
                          *(str(p) for w in works.values() for p in (w / "export", w / "loads.pt", w / "sglang.pt"))],
                         cwd=REPO, env=node_env("cpu"), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = {}
    for variant, work in works.items():
        export_dir, stream = work / "export", streams[variant]
        files = SafetensorsDir(export_dir)
        out[variant] = dict(config=json.loads((export_dir / "config.json").read_text()), stream=dict(stream),
                            stream_names=[name for name, _ in stream],
                            exported={name: files.read(name) for name in files.shapes()},
                            sglang=torch.load(work / "sglang.pt", weights_only=False))
    return out


@pytest.mark.megatron  # converts and builds the Megatron policy (megatron-core 0.19, in a process of its own)
@pytest.mark.parametrize("source", ["export", "sync"])
@pytest.mark.parametrize("variant", list(SGLANG_CLASS))
def test_sglang_loads_every_dsa_tensor_we_send(loaded, variant, source):
    loaded = loaded[variant]
    config, result = loaded["config"], loaded["sglang"]["loads"][source]
    named = loaded["exported"] if source == "export" else loaded["stream"]
    assert loaded["sglang"]["class"] == SGLANG_CLASS[variant]
    assert config["index_topk"] == 4 and config["q_lora_rank"]
    expected, dropped = expected_params(named, config)
    assert not dropped  # the tiny models have no MTP layer
    indexer = [name for name in expected if ".self_attn.indexer." in name]
    assert len(indexer) == 5 * config["num_hidden_layers"], indexer  # wq_b, wk, k_norm weight + bias, weights_proj
    bf16 = [name for name in expected if name.endswith(BF16_IN_SGLANG)]
    assert len(bf16) == config["num_hidden_layers"] and all(named[n].dtype == torch.float32 for n in bf16)
    assert all(result["params"][n].dtype == torch.bfloat16 for n in bf16)
    assert not all(torch.equal(named[n].bfloat16().float(), named[n]) for n in bf16), "bf16 holds ours exactly"
    expected.update((name, named[name].bfloat16()) for name in bf16)
    assert_loaded_equal(result, expected, config["vocab_size"], source)
    moe_layers = list(range(config["first_k_dense_replace"], config["num_hidden_layers"]))
    assert sorted(result["routing_bias"]) == moe_layers
    for i in moe_layers:
        bias = named[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
        assert bias.abs().min() > 0 and torch.equal(result["routing_bias"][i], bias)
    nope = config["qk_nope_head_dim"]
    for i in range(config["num_hidden_layers"]):
        kv_b = named[f"model.layers.{i}.self_attn.kv_b_proj.weight"].unflatten(0, (config["num_attention_heads"], -1))
        assert torch.equal(result["w_kc"][i], kv_b[:, :nope]) and torch.equal(result["w_vc"][i], kv_b[:, nope:].mT)
    print(f"{variant} {source}: {len(named)} names -> {len(result['params'])} SGLang parameters, max diff 0.0")


@pytest.mark.megatron
@pytest.mark.parametrize("variant", list(SGLANG_CLASS))
def test_the_sync_sends_the_exports_names(loaded, variant):
    stream, exported = loaded[variant]["stream"], loaded[variant]["exported"]
    assert sorted(loaded[variant]["stream_names"]) == sorted(exported)  # each once
    assert all(torch.equal(stream[n], exported[n]) for n in exported)


if __name__ == "__main__":
    export_and_stream(*sys.argv[1:])
