"""Our DeepSeek-V3 tensor names and shapes are what SGLang's ``DeepseekV2ForCausalLM`` loads, checked against its own
code. SGLang's CPU attention cannot run MLA (docs/models.md), so no server is started: ``sglang_load`` builds SGLang's
model class in a process of its own and feeds its real ``load_weights`` (issue 25).

For the tiny DeepSeek-V3 (q LoRA, two shared experts, an MTP layer in the checkpoint) and Moonlight (no q LoRA, one
``q_proj``), each with a dense first layer and a sigmoid router with a nonzero ``e_score_correction_bias``, two
sources of (name, tensor) pairs are loaded, each into a model whose every parameter was first set to NaN:

- ``export``: conversion's output (hf -> Megatron -> ``megatron_to_hf``, world 1), read by SGLang's own safetensors
  iterator in one call, as its server's start-up load does.
- ``sync``: the weight sync's stream (``Bridge.export_to_sender`` of the policy) cut by ``weight_sync.buckets`` at
  its smallest (every tensor a bucket of its own unless held), one ``load_weights`` call per bucket, as
  ``update_weights_from_distributed`` does.

Each SGLang parameter must equal our tensors joined as its loader joins them (``expected_params``), all of it written
(no NaN left): every name we send lands, whole, where SGLang routes with it. Nothing is logged as "not found"; the
MTP layer's names are the only ones dropped, by design (SGLang's DeepseekV2 skips layers >= num_hidden_layers unless
loading its NEXTN draft model). ``w_kc`` / ``w_vc`` (what its MLA multiplies with, split from ``kv_b_proj`` after the
load) and the top-k's correction bias are checked too. fp32 throughout: equality is exact. A third load, ``sync_bf16``,
is the stream as a bf16 weight sync sends it: SGLang must route with the trainer's fp32 bias, bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.model import hf_tiny

from .helpers import require_sglang

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {"deepseek_v3": 11, "moonlight": 12}  # variant: seed
VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")


def assert_loaded_equal(result: dict, expected: dict[str, torch.Tensor], vocab_size: int, source: str) -> None:
    """SGLang's load ``result`` (its parameters and warnings) holds exactly ``expected``: the same names, every
    element written (the load leaves NaN where nothing was), every tensor equal. SGLang pads the vocabulary rows of
    the embedding and head to a multiple of 64 (Moonlight's 100 -> 128): compared up to ``vocab_size``."""
    params = result["params"]
    assert set(params) == set(expected), (sorted(set(params) - set(expected)), sorted(set(expected) - set(params)))
    unwritten = [name for name, p in params.items() if p.isnan().any()]
    assert not unwritten, f"SGLang parameters {source} left (partly) unwritten: {unwritten}"
    params = {name: p[:vocab_size] if name in VOCAB_PARAMS else p for name, p in params.items()}
    wrong = {name: (tuple(p.shape), tuple(expected[name].shape)) for name, p in params.items()
             if p.shape != expected[name].shape or not torch.equal(p, expected[name])}
    assert not wrong, wrong
    assert not result["warnings"], result["warnings"]


def export_and_load(work: Path, variant: str, seed: int) -> dict:
    """One tiny ``variant`` (hf_tiny.save_variant) converted and exported on one rank, then loaded by SGLang's own
    model class in a process of its own (tests/rollout/sglang_load.py): the export as one call, the weight-sync
    stream one tensor per call. -> config, stream, buckets, exported, and SGLang's load results."""
    require_sglang()
    from gspo_megatron.model.hf_files import SafetensorsDir
    from gspo_megatron.parallel.groups import Layout
    from gspo_megatron.parallel.launch import run_on_ranks
    from gspo_megatron.rollout.server import node_env
    from gspo_megatron.rollout.weight_sync import buckets

    hf_dir = hf_tiny.save_variant(variant, work, seed=seed)
    export_dir = work / "export"
    ((stream,),) = run_on_ranks(_convert_and_stream, 1, Layout(), [(str(hf_dir), str(work / "megatron"),
                                                                     str(export_dir))], timeout=300)
    files = SafetensorsDir(export_dir)
    loads = {"export": ["files"], "sync": list(buckets(stream, bucket_bytes=1))}
    torch.save(loads, work / "loads.pt")
    run = subprocess.run([sys.executable, "-m", "tests.rollout.sglang_load", str(export_dir), str(work / "loads.pt"),
                          str(work / "sglang.pt")], cwd=REPO, env=node_env("cpu"), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return dict(config=json.loads((export_dir / "config.json").read_text()), stream=dict(stream), buckets=loads["sync"],
                exported={name: files.read(name) for name in files.shapes()},
                sglang=torch.load(work / "sglang.pt", weights_only=False))


def _convert_and_stream(dirs: list[tuple[str, str, str]]) -> list[list]:
    """On one rank, per (hf_dir, megatron_dir, export_dir): conversion's export to ``export_dir``, and the policy's
    weight-sync stream (name, tensor)."""
    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.convert import hf_to_megatron, megatron_to_hf
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.provider import build_gpt_model
    from gspo_megatron.parallel.groups import Layout

    streams = []
    for hf_dir, megatron_dir, export_dir in dirs:
        hf_to_megatron(hf_dir, megatron_dir, Layout())
        megatron_to_hf(megatron_dir, export_dir, None, Layout())
        spec = read_hf_config(hf_dir)
        bridge = Bridge(spec)
        model = build_gpt_model(spec, Layout())
        bridge.load_hf_weights(model, hf_dir)
        streams.append([(name, tensor.clone()) for name, tensor in bridge.export_to_sender(model)])
    return streams


def _bf16_sync(stream: list) -> list:
    """The stream as a bf16 weight sync sends it (``weight_sync.dtype="bfloat16"``): each bucket's tensors cast as
    the sender packs them, the router's bias kept fp32 (``mapping.export_dtype``)."""
    from gspo_megatron.model.mapping import export_dtype
    from gspo_megatron.rollout.weight_sync import buckets

    return [[(n, t.to(export_dtype(n, t, torch.bfloat16))) for n, t in bucket]
            for bucket in buckets(stream, bucket_bytes=64 << 10, dtype=torch.bfloat16)]


def expected_params(named: dict[str, torch.Tensor], config: dict) -> tuple[dict[str, torch.Tensor], list[str]]:
    """SGLang's parameters as its ``load_weights`` builds them from HF tensors, and the names it drops by design.

    Its joins (deepseek_weight_loader.py): ``fused_qkv_a_proj_with_mqa`` = [q_a_proj; kv_a_proj_with_mqa] (q LoRA
    only), ``gate_up_proj`` = [gate_proj; up_proj] (dense MLP, shared experts), the routed experts stacked as
    ``experts.w13_weight[e]`` = [gate; up] and ``experts.w2_weight[e]`` = down. Every other name is its parameter's.
    Each of our names is used exactly once; one that fits no rule raises."""
    layers, experts = config["num_hidden_layers"], config["n_routed_experts"]
    out, used, dropped = {}, set(), []

    def take(*names):
        used.update(names)
        return [named[n] for n in names]

    for name in named:
        index = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if index is not None and index >= layers:
            dropped.append(name)  # an MTP layer: SGLang's NEXTN draft model loads it, not DeepseekV2
            used.add(name)
    for i in range(layers):
        prefix = f"model.layers.{i}"
        attn = f"{prefix}.self_attn"
        if config.get("q_lora_rank"):
            out[f"{attn}.fused_qkv_a_proj_with_mqa.weight"] = torch.cat(
                take(f"{attn}.q_a_proj.weight", f"{attn}.kv_a_proj_with_mqa.weight"))
        mlp = f"{prefix}.mlp"
        glu = [mlp] if i < config["first_k_dense_replace"] else [f"{mlp}.shared_experts"]
        for module in glu:
            out[f"{module}.gate_up_proj.weight"] = torch.cat(take(f"{module}.gate_proj.weight",
                                                                  f"{module}.up_proj.weight"))
        if i >= config["first_k_dense_replace"]:
            e = f"{mlp}.experts"
            out[f"{e}.w13_weight"] = torch.stack(
                [torch.cat(take(f"{e}.{x}.gate_proj.weight", f"{e}.{x}.up_proj.weight")) for x in range(experts)])
            out[f"{e}.w2_weight"] = torch.stack([take(f"{e}.{x}.down_proj.weight")[0] for x in range(experts)])
    for name in named:
        if name not in used:
            out[name] = named[name]
            used.add(name)
    return out, dropped


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Per variant: our tensors (export files, sync stream), its config, and what SGLang's load_weights made of them.
    Both variants in one policy process and one SGLang process (each import paid once)."""
    require_sglang()
    from gspo_megatron.model.hf_files import SafetensorsDir
    from gspo_megatron.parallel.groups import Layout
    from gspo_megatron.parallel.launch import run_on_ranks
    from gspo_megatron.rollout.server import node_env
    from gspo_megatron.rollout.weight_sync import buckets

    work = {variant: tmp_path_factory.mktemp(variant) for variant in VARIANTS}
    hf_dirs = {variant: hf_tiny.save_variant(variant, work[variant], seed=seed) for variant, seed in VARIANTS.items()}
    dirs = [(str(hf_dirs[v]), str(work[v] / "megatron"), str(work[v] / "export")) for v in VARIANTS]
    (streams,) = run_on_ranks(_convert_and_stream, 1, Layout(), dirs, timeout=300)
    out, args = {}, []
    for variant, stream in zip(VARIANTS, streams):
        export_dir = work[variant] / "export"
        files = SafetensorsDir(export_dir)
        exported = {name: files.read(name) for name in files.shapes()}
        loads = {"export": ["files"], "sync": list(buckets(stream, bucket_bytes=1)), "sync_bf16": _bf16_sync(stream)}
        torch.save(loads, work[variant] / "loads.pt")
        args += [str(export_dir), str(work[variant] / "loads.pt"), str(work[variant] / "sglang.pt")]
        out[variant] = dict(config=json.loads((export_dir / "config.json").read_text()), exported=exported,
                            source_config=json.loads((hf_dirs[variant] / "config.json").read_text()),
                            stream=dict(stream), stream_names=[name for name, _ in stream], buckets=loads["sync"],
                            bf16_buckets=loads["sync_bf16"])
    run = subprocess.run([sys.executable, "-m", "tests.rollout.sglang_load", *args], cwd=REPO, env=node_env("cpu"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for variant in VARIANTS:
        out[variant]["sglang"] = torch.load(work[variant] / "sglang.pt", weights_only=False)
    return out


@pytest.mark.megatron  # converts and builds the Megatron policy
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("source", ["export", "sync"])
def test_sglang_loads_every_tensor_we_send(loaded, variant, source):
    case = loaded[variant]
    config, result = case["config"], case["sglang"]["loads"][source]
    named = case["exported"] if source == "export" else case["stream"]
    assert case["sglang"]["class"] == "DeepseekV3ForCausalLM"
    expected, dropped = expected_params(named, config)
    assert_loaded_equal(result, expected, config["vocab_size"], source)
    # The MTP layer: in conversion's export (copied from the checkpoint), never in the sync stream; dropped by SGLang.
    layers = config["num_hidden_layers"]
    assert dropped == [n for n in named if n.startswith(f"model.layers.{layers}.")]
    assert bool(dropped) == (source == "export" and variant in hf_tiny.WITH_MTP_TENSORS)
    # What SGLang computes with: the top-k's correction bias, MLA's halves of kv_b_proj ([heads, nope | v, kv_lora]).
    moe_layers = list(range(config["first_k_dense_replace"], layers))
    assert sorted(result["routing_bias"]) == moe_layers
    for i in moe_layers:
        bias = named[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
        assert bias.abs().min() > 0 and torch.equal(result["routing_bias"][i], bias)
    nope = config["qk_nope_head_dim"]
    for i in range(layers):
        kv_b = named[f"model.layers.{i}.self_attn.kv_b_proj.weight"].unflatten(0, (config["num_attention_heads"], -1))
        assert torch.equal(result["w_kc"][i], kv_b[:, :nope]) and torch.equal(result["w_vc"][i], kv_b[:, nope:].mT)
    sent = len(named) - len(dropped)
    print(f"{variant} {source}: {sent} names -> {len(result['params'])} SGLang parameters, max diff 0.0, "
          f"{len(dropped)} MTP names dropped by design")


@pytest.mark.megatron
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_sync_sends_the_exports_names(loaded, variant):
    """The weight sync's names are conversion's export's, less the MTP layer (the policy has none), equal tensors."""
    case = loaded[variant]
    layers = case["config"]["num_hidden_layers"]
    exported = {n: t for n, t in case["exported"].items() if not n.startswith(f"model.layers.{layers}.")}
    assert sorted(case["stream_names"]) == sorted(exported)  # each once
    assert all(torch.equal(case["stream"][n], exported[n]) for n in exported)


@pytest.mark.megatron
def test_a_cut_between_the_fused_down_projections_is_held(loaded):
    """At the smallest bucket every tensor travels alone but q_a_proj, which waits for kv_a_proj_with_mqa: SGLang
    caches the first of the two only for the call it came in (a bucket ending between them leaves its fused
    parameter unwritten, silently: the NaN check above catches it, as it did before the cut was held)."""
    names = [[name for name, _ in bucket] for bucket in loaded["deepseek_v3"]["buckets"]]
    pairs = [b for b in names if len(b) > 1]
    layers = loaded["deepseek_v3"]["config"]["num_hidden_layers"]
    assert pairs == [[f"model.layers.{i}.self_attn.q_a_proj.weight", f"model.layers.{i}.self_attn.kv_a_proj_with_mqa"
                      ".weight"] for i in range(layers)]
    assert all(len(b) == 1 for b in [[name for name, _ in bucket] for bucket in loaded["moonlight"]["buckets"]])


@pytest.mark.megatron
def test_the_export_writes_the_config_fields_sglang_reads(loaded):
    """The tiny checkpoints are transformers saves without moe_layer_freq / topk_method / scoring_func (SGLang's
    DeepseekV2 fails to build without them); conversion's export writes DeepSeek-V3's values, and SGLang built."""
    from gspo_megatron.model.hf_config import FAMILIES

    fields = FAMILIES["deepseek_v3"].serving_fields
    for case in loaded.values():
        assert not set(fields) & set(case["source_config"])
        assert {key: case["config"][key] for key in fields} == fields


@pytest.mark.megatron
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_bf16_sync_routes_with_the_trainers_fp32_bias(loaded, variant):
    """A bf16 weight sync (the sender's cast) into SGLang: its top-k routes with the trainer's fp32 correction bias,
    bit for bit (its gate keeps the bias fp32; a bias cast to bf16 would route with rounded values: other experts),
    in mixed-dtype buckets; every other parameter holds the bf16-rounded tensor."""
    case = loaded[variant]
    result = case["sglang"]["loads"]["sync_bf16"]
    sent = {n: t for bucket in case["bf16_buckets"] for n, t in bucket}
    mixed = [b for b in case["bf16_buckets"] if len({t.dtype for _, t in b}) > 1]
    assert mixed, "the biases travel in buckets of their own: mixed-dtype buckets are not under test"
    biases = {n: t for n, t in case["stream"].items() if n.endswith(".e_score_correction_bias")}
    assert biases and all(sent[n].dtype == torch.float32 for n in biases)
    assert all(t.dtype == torch.bfloat16 for n, t in sent.items() if n not in biases)
    for i, bias in result["routing_bias"].items():
        trainer = biases[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
        assert not torch.equal(trainer.bfloat16().float(), trainer), "a bias bf16 holds exactly tests nothing"
        assert hf_tiny.same_bits(bias, trainer), f"layer {i}: SGLang routes with another bias than the trainer's"
    expected, _ = expected_params({n: t.float() for n, t in sent.items()}, case["config"])
    params = {name: p[: case["config"]["vocab_size"]] if name in VOCAB_PARAMS else p
              for name, p in result["params"].items()}
    assert set(params) == set(expected) and not result["warnings"], result["warnings"]
    wrong = [name for name, p in params.items() if not torch.equal(p, expected[name])]
    assert not wrong, wrong
