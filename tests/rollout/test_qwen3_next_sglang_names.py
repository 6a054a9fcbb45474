"""Our Qwen3-Next and Qwen3.5-MoE tensors are what SGLang's ``Qwen3NextForCausalLM`` and
``Qwen3_5MoeForConditionalGeneration`` load, checked against its own code, in-process
(``sglang_load``, as ``test_minimax_m2_sglang_names`` does): conversion's export (hf -> Megatron -> ``megatron_to_hf``
at world 1, read by SGLang's safetensors iterator) and the weight sync's stream (``Bridge.export_to_sender``, one
tensor a bucket, one ``load_weights`` call each), each loaded into a model whose every parameter was first set to NaN.
Every SGLang parameter must be written whole and equal ours through its joins (``expected_params``): the full-attention
layers' ``qkv_proj`` = [q (with its gate); k; v] and their ``o_proj`` / ``q_norm`` / ``k_norm`` one level up (SGLang's
layer holds them itself, no ``self_attn``), the shared expert's ``gate_up_proj`` = [gate; up], the routed experts'
``w13_weight`` / ``w2_weight`` stacked; the gated DeltaNet's ``in_proj_qkvz``, ``in_proj_ba``, ``conv1d``, ``A_log``,
``dt_bias``, ``norm`` and ``out_proj`` as they are (Qwen3.5's ``in_proj_qkv`` + ``in_proj_z`` and ``in_proj_b`` +
``in_proj_a`` joined; its language model under ``model.``). The export's MTP layer (``mtp.*``, carried from the
checkpoint) is dropped by design (SGLang's ``Qwen3NextForCausalLMMTP`` loads it as the draft);
the stream has none.
The export's config.json carries ``full_attention_interval`` (``hf_config.serving_config``): SGLang's own
``Qwen3NextConfig`` places its layers by it alone (Qwen3.5's text configs derive from it: in its ``text_config``).

Qwen3.5-MoE's vision tower (carried, not trained) is in the export and must load whole too: ``model.visual.*`` as
SGLang's ``visual.*``, its attention's ``qkv`` as ``qkv_proj``. The tiny's vision config is the releases' shape:
``deepstack_visual_indexes: []`` (absent, SGLang's Qwen3-VL default builds three deepstack mergers no Qwen3.5
checkpoint has) and 64 position embeddings (SGLang pads ``pos_embed``'s rows to a multiple of 64, as the releases'
2304 already are). The weight sync sends the language model only, so the servers keep the vision tower they started
with.
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
from .test_deepseek_sglang_names import _convert_and_stream, assert_loaded_equal

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {"qwen3_next": 23, "qwen3_5_moe": 24}  # variant: seed
CLASSES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
VISION = "model.visual."


def expected_params(named: dict[str, torch.Tensor], layers: int, experts: int) -> tuple[dict, list[str]]:
    """SGLang's parameters as its ``load_weights`` builds them from our HF tensors, and the names it drops by design;
    each of ours used once."""
    out, used = {}, set()
    dropped = [name for name in named if name.startswith("mtp.")]
    used.update(dropped)

    def take(*names):
        used.update(names)
        return [named[n] for n in names]

    source = "model.language_model" if any(n.startswith("model.language_model.") for n in named) else "model"
    for i in range(layers):
        layer, attn, moe = f"{source}.layers.{i}", f"{source}.layers.{i}.self_attn", f"{source}.layers.{i}.mlp"
        if f"{attn}.q_proj.weight" in named:  # a full-attention layer
            out[f"model.layers.{i}.qkv_proj.weight"] = torch.cat(take(*(f"{attn}.{p}_proj.weight" for p in "qkv")))
            for rest in ("o_proj.weight", "q_norm.weight", "k_norm.weight"):
                out[f"model.layers.{i}.{rest}"] = take(f"{attn}.{rest}")[0]
        delta = f"{layer}.linear_attn"
        if f"{delta}.in_proj_qkv.weight" in named:  # Qwen3.5's DeltaNet: SGLang joins [qkv; z] and [b; a]
            out[f"model.layers.{i}.linear_attn.in_proj_qkvz.weight"] = torch.cat(take(f"{delta}.in_proj_qkv.weight",
                                                                                     f"{delta}.in_proj_z.weight"))
            out[f"model.layers.{i}.linear_attn.in_proj_ba.weight"] = torch.cat(take(f"{delta}.in_proj_b.weight",
                                                                                   f"{delta}.in_proj_a.weight"))
        shared = f"{moe}.shared_expert"
        ours = f"model.layers.{i}.mlp"
        out[f"{ours}.shared_expert.gate_up_proj.weight"] = torch.cat(take(f"{shared}.gate_proj.weight",
                                                                          f"{shared}.up_proj.weight"))
        out[f"{ours}.experts.w13_weight"] = torch.stack([torch.cat(take(f"{moe}.experts.{e}.gate_proj.weight",
                                                                        f"{moe}.experts.{e}.up_proj.weight"))
                                                         for e in range(experts)])
        out[f"{ours}.experts.w2_weight"] = torch.stack(take(*(f"{moe}.experts.{e}.down_proj.weight"
                                                               for e in range(experts))))
    # the vision tower one level up, its attention's qkv as SGLang's qkv_proj (SGLang's Qwen3_VisionBlock)
    for name in [name for name in named if name.startswith(VISION)]:
        out[name.removeprefix("model.").replace(".attn.qkv.", ".attn.qkv_proj.")] = take(name)[0]
    # the rest as they are, a wrapper's language model under model. (SGLang's Qwen3_5MoeForConditionalGeneration)
    out.update((name.replace("model.language_model.", "model."), tensor) for name, tensor in named.items()
               if name not in used)
    return out, dropped


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Per variant: our tensors (export files, sync stream), its text config, and what SGLang's load_weights made of
    them; both variants in one policy process and one SGLang process."""
    require_sglang()
    from gspo_megatron.model.hf_config import text_config
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
        loads = {"export": ["files"], "sync": list(buckets(stream, bucket_bytes=1))}
        torch.save(loads, work[variant] / "loads.pt")
        args += [str(export_dir), str(work[variant] / "loads.pt"), str(work[variant] / "sglang.pt")]
        out[variant] = dict(config=text_config(json.loads((export_dir / "config.json").read_text())),
                            stream=dict(stream), buckets=loads["sync"], exported=exported)
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
    assert case["sglang"]["class"] == CLASSES[variant]
    assert config["full_attention_interval"] == 4
    assert source == "export" or len(case["buckets"]) == len(named)  # every tensor a call of its own
    expected, dropped = expected_params(named, config["num_hidden_layers"], config["num_experts"])
    assert bool(dropped) == (source == "export")  # the MTP layer: carried by the export, not in the policy
    vision = [n for n in result["params"] if n.startswith("visual.")]
    assert bool(vision) == (variant == "qwen3_5_moe")
    if source == "sync":  # the language model only: the vision tower is not trained, so not synced (left NaN here)
        result = {**result, "params": {n: p for n, p in result["params"].items() if n not in vision}}
    assert_loaded_equal(result, expected, config["vocab_size"], source)
    print(f"{variant} {source}: {len(named) - len(dropped)} names -> {len(result['params'])} SGLang parameters, "
          f"max diff 0.0, {len(dropped)} MTP names dropped by design")


@pytest.mark.megatron
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_sync_sends_the_exports_names(loaded, variant):
    stream = loaded[variant]["stream"]
    exported = {n: t for n, t in loaded[variant]["exported"].items() if not n.startswith(("mtp.", VISION))}
    assert sorted(stream) == sorted(exported) and all(torch.equal(stream[n], exported[n]) for n in exported)
