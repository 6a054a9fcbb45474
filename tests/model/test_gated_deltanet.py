"""The gated-DeltaNet hybrids (Qwen3.5-MoE and dense Qwen3.5 as vision-language checkpoints, Qwen3-Next as a causal LM):
config, load, convert.

Tiny random models built with transformers 5.19 (``hf_tiny.HYBRID_VARIANTS``: three DeltaNet layers and one gated
full-attention layer, 2 key / 4 value heads, partial rotary 0.25, a gated shared expert; Qwen3.5-MoE saved as
``Qwen3_5MoeForConditionalGeneration`` with its vision tower and a few ``mtp.*`` tensors; Qwen3-Next with its
per-key-head ``in_proj_qkvz`` / ``in_proj_ba`` and ``mtp.*`` tensors). One launch of 2 gloo ranks
(``_cases``) checks, for each model: the Megatron policy's logits equal transformers' (fp32, <= 1e-4) at world 1 (two
replicas, weights from a dict), TP2 (which splits the DeltaNet's key and value heads: one key head and its two value
heads per rank), PP2 (two DeltaNet layers on stage 0; a DeltaNet layer and the attention layer on stage 1) and, for the
MoEs, EP2 and TP2 x EP2; the export (and the weight-sync export to each stage's sender) is the checkpoint bit for bit;
and HF -> Megatron -> HF conversion under two different layouts gives every tensor back bit for bit, the vision tower
and MTP tensors carried.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gspo_megatron.model import mapping
from gspo_megatron.model.errors import UnsupportedModel
from gspo_megatron.model.hf_config import read_hf_config, serving_config
from gspo_megatron.model.hf_files import SafetensorsDir
from gspo_megatron.model.layout_check import LayoutError, check_layout
from gspo_megatron.parallel.groups import Layout
from tests.model import hf_tiny, rank_checks

ATOL = 1e-4
MOE = "qwen3_5_moe"
NEXT = "qwen3_next"
MOES = (MOE, NEXT)
TP2_SP = Layout(tensor=2, sequence_parallel=True)
MIXED = Layout(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True)
BRIDGE_LAYOUTS = {"tp1_dict": Layout(), "tp2": TP2_SP, "pp2": Layout(pipeline=2), "ep2": Layout(expert=2),
                  "tp2_ep2_etp1": MIXED}
DENSE_LAYOUTS = ("tp1_dict", "tp2", "pp2")
# transformers' re-save of Qwen3.5-MoE's text model (hf_tiny.save_resaved_text_model): converted and scored only
RESAVED = "qwen3_5_moe_text"
CONVERT_LAYOUTS = {MOE: (MIXED, Layout(pipeline=2)), "qwen3_5": (Layout(pipeline=2), Layout(tensor=2)),
                   NEXT: (TP2_SP, MIXED), RESAVED: (Layout(pipeline=2), MIXED)}


def _cases(models: dict, work: Path) -> list:
    cases = []
    for name, path in models.items():
        kinds = (BRIDGE_LAYOUTS if name in MOES else {} if name == RESAVED
                 else {k: BRIDGE_LAYOUTS[k] for k in DENSE_LAYOUTS})
        for kind, layout in kinds.items():
            source = "dict" if kind == "tp1_dict" else "dir"
            cases.append((("bridge", name, kind), rank_checks.bridge_case, (str(path), layout, source), layout))
        there, back = CONVERT_LAYOUTS[name]
        megatron_dir = str(work / "megatron" / name)
        cases.append((("to_megatron", name), rank_checks.to_megatron_case, (str(path), megatron_dir, there), there))
        cases.append((("to_hf", name), rank_checks.to_hf_case, (megatron_dir, str(work / "hf_back" / name), str(path),
                                                                  back), back))
        vocab = read_hf_config(path).vocab_size  # score: the converted checkpoint as read back, the HF dir as loaded
        cases.append((("score", name, "megatron"), rank_checks.score_case, (megatron_dir, back, vocab), back))
        cases.append((("score", name, "hf"), rank_checks.score_case, (str(path), there, vocab), there))
    return rank_checks.in_run_order(cases)


@pytest.fixture(scope="module")
def resaved_model(hybrid_models, tmp_path_factory):
    return hf_tiny.save_resaved_text_model(hybrid_models[MOE], tmp_path_factory.mktemp("resaved") / RESAVED)


@pytest.fixture(scope="module")
def hybrid_results(hybrid_models, resaved_model, tmp_path_factory):
    from gspo_megatron.parallel.launch import run_on_ranks

    work = tmp_path_factory.mktemp("hybrid_work")
    cases = _cases({**hybrid_models, RESAVED: resaved_model}, work)
    return run_on_ranks(rank_checks.run_cases, 2, None, cases, timeout=480), work


def test_configs_read_as_megatron_fields(hybrid_models):
    moe, dense = read_hf_config(hybrid_models[MOE]), read_hf_config(hybrid_models["qwen3_5"])
    for spec in (moe, dense):
        assert spec.linear_attention_layers == (True, True, True, False)  # layer_types: every 4th full attention
        assert (spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_key_head_dim,
                spec.linear_value_head_dim, spec.linear_conv_kernel_dim) == (2, 4, 8, 8, 4)
        assert spec.attention_output_gate and spec.zero_centered_norm and spec.qk_norm
        assert spec.rotary_percent == 0.25 and spec.text_model_prefix == "model.language_model."
    assert moe.family == "qwen3_5_moe_text" and dense.family == "qwen3_5_text"
    assert moe.moe_layers == (True,) * 4 and moe.norm_topk_prob and moe.moe_shared_expert_gate
    assert moe.moe_shared_ffn_hidden_size == 24 and moe.mtp_layers == 1 and not dense.is_moe
    names = SafetensorsDir(hybrid_models[MOE]).shapes()
    carried = {n for n in names if mapping.is_carried(moe, n)}
    assert carried == {n for n in names if n.startswith(("model.visual.", "mtp."))} and len(carried) > 20
    assert "lm_head.weight" not in carried and mapping.mtp_layer_of(moe, "mtp.layers.0.self_attn.q_proj.weight") == 0


def test_qwen3_next_reads_as_a_causal_lm_with_per_head_in_proj(hybrid_models):
    """Qwen3-Next: the text model at the top level (no wrapper), the same DeltaNet / gated attention / gated shared
    expert fields, and in_proj_qkvz / in_proj_ba per key head, which the "per_head" join turns into megatron's
    [q; k; v; z; b; a] (and back, exactly)."""
    from gspo_megatron.model import sharding

    spec = read_hf_config(hybrid_models[NEXT])
    config = json.loads((hybrid_models[NEXT] / "config.json").read_text())
    assert "full_attention_interval" not in config  # transformers saves layer_types; SGLang's config reads the interval
    assert serving_config(config)["full_attention_interval"] == 4
    irregular = {**config, "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"]}
    assert "full_attention_interval" not in serving_config(irregular)
    assert spec.family == NEXT and not spec.text_model_prefix and spec.linear_attention_layers == (True,) * 3 + (False,)
    with pytest.raises(LayoutError, match="linear_num_key_heads=2 .*tensor_model_parallel_size=4"):
        check_layout(spec, Layout(tensor=4, sequence_parallel=True))
    assert spec.moe_shared_expert_gate and spec.zero_centered_norm and spec.rotary_percent == 0.25
    assert spec.mtp_layers == 1 and mapping.is_carried(spec, "mtp.fc.weight")
    assert not mapping.is_carried(spec, "model.layers.0.linear_attn.in_proj_qkvz.weight")
    nk, nv, dk, dv, rest = 2, 4, 3, 5, 7  # value heads per key head 2; key and value head dims differ
    q, k = torch.randn(nk, dk, rest), torch.randn(nk, dk, rest)
    v, z = torch.randn(nv, dv, rest), torch.randn(nv, dv, rest)
    b, a = torch.randn(nk, 2, rest), torch.randn(nk, 2, rest)
    qkvz = torch.cat([q, k, v.reshape(nk, 2 * dv, rest), z.reshape(nk, 2 * dv, rest)], dim=1).reshape(-1, rest)
    ba = torch.cat([b, a], dim=1).reshape(-1, rest)
    sizes = ((dk, dk, 2 * dv, 2 * dv), (2, 2))
    for tp in (1, 2):  # a rank holds whole key heads: the tensors' rows split in tp blocks
        for r in range(tp):
            local = sharding.join(mapping.PER_HEAD, [qkvz.chunk(tp)[r], ba.chunk(tp)[r]], 0, 0, sizes)
            h = slice(r * nk // tp, (r + 1) * nk // tp)
            vh = slice(r * nv // tp, (r + 1) * nv // tp)
            wanted = torch.cat([t.reshape(-1, rest) for t in (q[h], k[h], v[vh], z[vh], b[h], a[h])])
            assert torch.equal(local, wanted), (tp, r)
            back = sharding.unjoin(mapping.PER_HEAD, local, 0, 0, (qkvz.shape[0] // tp, ba.shape[0] // tp), sizes)
            assert torch.equal(back[0], qkvz.chunk(tp)[r]) and torch.equal(back[1], ba.chunk(tp)[r]), (tp, r)


def test_layer_pattern_from_full_attention_interval_and_refusals(hybrid_models):
    config = json.loads((hybrid_models["qwen3_5"] / "config.json").read_text())
    text = {k: v for k, v in config["text_config"].items() if k != "layer_types"}
    interval = read_hf_config({**config, "text_config": {**text, "full_attention_interval": 2}})
    assert interval.linear_attention_layers == (True, False, True, False)
    with pytest.raises(UnsupportedModel, match="sliding_attention"):
        read_hf_config({**config, "text_config": {**text, "layer_types": ["sliding_attention"] * 4}})
    with pytest.raises(UnsupportedModel, match="linear_num_value_heads=3"):
        read_hf_config({**config, "text_config": {**text, "linear_num_value_heads": 3}})


@torch.no_grad()
def test_interleaved_mrope_is_one_dimensional_rope_for_text():
    """Qwen3.5's rope interleaves temporal / height / width frequencies (mrope_section); a text token has one
    position on all three axes, so each frequency rotates by the same position: megatron's 1-D RoPE on the first
    quarter of each head (rotary_percent 0.25) is what transformers computes."""
    import transformers
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    _, kwargs = hf_tiny.HYBRID_VARIANTS[MOE]
    config = transformers.Qwen3_5MoeTextConfig(**kwargs["text_config"])
    rope = Qwen3_5MoeTextRotaryEmbedding(config)
    positions = torch.arange(12)[None]
    cos, sin = rope(torch.zeros(1), positions)
    rotary = int(config.head_dim * 0.25)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2).float() / rotary))
    angles = torch.cat([positions[0, :, None].float() * inv_freq] * 2, dim=-1)
    assert cos.shape[-1] == rotary and torch.allclose(cos[0], angles.cos()) and torch.allclose(sin[0], angles.sin())
    vision = torch.stack([positions, positions + 1, positions + 2])  # distinct axes, as an image patch has
    assert not torch.allclose(rope(torch.zeros(1), vision)[0], cos), "the sections did not matter: a weak check"


@pytest.mark.megatron  # builds Megatron models
@pytest.mark.parametrize("variant", list(hf_tiny.HYBRID_VARIANTS))
def test_logits_equal_transformers_and_export_is_bitwise(variant, hybrid_models, hybrid_results):
    results, _ = hybrid_results
    names = set(SafetensorsDir(hybrid_models[variant]).shapes())
    spec = read_hf_config(hybrid_models[variant])
    trained = {n for n in names if not mapping.is_carried(spec, n)}
    kinds = BRIDGE_LAYOUTS if variant in MOES else DENSE_LAYOUTS
    for kind in kinds:
        per_rank = rank_checks.result(results, ("bridge", variant, kind))
        diffs = [r["logits_diff"] for r in per_rank if "logits_diff" in r]
        assert diffs and max(diffs) <= ATOL, f"{kind}: logits differ by {max(diffs):.2e} > {ATOL}"
        for rank, r in enumerate(per_rank):
            assert not r["not_bitwise"] and not r["to_sender_not_bitwise"], (kind, rank, r["not_bitwise"])
            assert r["export_names_match"] and r["attention_class"] == "GatedDeltaNet", (kind, rank)
            assert r["to_sender"] == (r["exported"] if r["sender"] else []), (kind, rank)
        exported = [set(r["exported"]) for r in per_rank]
        if kind == "pp2":
            assert exported[0].isdisjoint(exported[1]) and exported[0] | exported[1] == trained, kind
        else:
            assert all(e == trained for e in exported), kind


@pytest.mark.megatron  # converts through Megatron models
@pytest.mark.parametrize("variant", list(hf_tiny.HYBRID_VARIANTS))
def test_conversion_round_trip_is_bitwise_with_vision_and_mtp_carried(variant, hybrid_models, hybrid_results):
    _, work = hybrid_results
    original, back = SafetensorsDir(hybrid_models[variant]), SafetensorsDir(work / "hf_back" / variant)
    assert set(back.shapes()) == set(original.shapes())
    differ = [n for n in original.shapes() if not hf_tiny.same_bits(back.read(n), original.read(n))]
    assert not differ, differ
    config = json.loads((work / "hf_back" / variant / "config.json").read_text())
    assert config["model_type"] == variant and ("vision_config" in config) == (variant != NEXT)
    assert (config.get("full_attention_interval") == 4) == (variant == NEXT)  # what SGLang's Qwen3NextConfig reads


@pytest.mark.megatron  # checks the Megatron model's results
@pytest.mark.parametrize("variant", list(hf_tiny.HYBRID_VARIANTS))
def test_score_equals_transformers_on_the_hf_dir_and_the_converted_checkpoint(variant, hybrid_models, hybrid_results):
    """``score`` (tests/tools/test_score.py's records: empty and 1-9 token responses in micro batches of 2 with a pad
    row) on the HF directory and on the Megatron checkpoint conversion wrote, each under a layout that splits the
    DeltaNet (CONVERT_LAYOUTS), against transformers' log-likelihoods (1e-4)."""
    from tests.tools.test_score import assert_agrees, transformers_loglik

    results, _ = hybrid_results
    records = rank_checks.score_records_for_tests(read_hf_config(hybrid_models[variant]).vocab_size)
    reference = transformers_loglik(hybrid_models[variant], records)
    for source in ("megatron", "hf"):
        per_rank = rank_checks.result(results, ("score", variant, source))
        assert per_rank[0]["megatron_checkpoint"] == (source == "megatron")
        for scored in (r["results"] for r in per_rank):
            assert_agrees(scored, reference)


def test_a_resaved_text_model_reads_under_the_names_transformers_wrote(hybrid_models, resaved_model, tmp_path):
    """Qwen3.5-MoE's release loaded as Qwen3_5MoeForCausalLM and saved again keeps model.language_model.* (transformers
    reverses its load-time rename on save) under model_type qwen3_5_moe_text; a text model built fresh saves model.*.
    transformers and SGLang load both, so both read: the tensor names decide (config.json says the same for both)."""
    import transformers

    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.hf_files import open_hf_dir, tensor_names

    shapes = open_hf_dir(resaved_model).shapes()
    resaved = read_hf_config(resaved_model).named_as(shapes)
    assert json.loads((resaved_model / "config.json").read_text())["model_type"] == RESAVED
    assert resaved.family == RESAVED and resaved.text_model_prefix == "model.language_model."
    assert read_hf_config(resaved_model).text_model_prefix == ""  # config.json alone cannot tell
    assert read_hf_config(resaved_model).named_as(tensor_names(resaved_model)) == resaved  # as training reads it
    Bridge(resaved).check_hf_tensors(shapes)  # every tensor mapped, none left over
    _, kwargs = hf_tiny.HYBRID_VARIANTS[MOE]
    transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kwargs["text_config"])).save_pretrained(
        tmp_path / "fresh")
    fresh = read_hf_config(tmp_path / "fresh").named_as(tensor_names(tmp_path / "fresh"))
    assert fresh.text_model_prefix == ""  # and otherwise the same model (the re-save's config keeps its MTP layer)
    assert replace(fresh, text_model_prefix=resaved.text_model_prefix, mtp_layers=1) == resaved
    Bridge(fresh).check_hf_tensors(open_hf_dir(tmp_path / "fresh").shapes())


@pytest.mark.megatron  # converts and scores through Megatron models
def test_a_resaved_text_model_converts_bitwise_and_scores_as_transformers(resaved_model, hybrid_results):
    """The re-saved text model through conversion (PP2 there, TP2 x EP2 back: every tensor bit for bit under its own
    names) and score on its directory and on its conversion (transformers' log-likelihoods, 1e-4)."""
    from tests.tools.test_score import assert_agrees, transformers_loglik

    results, work = hybrid_results
    original, back = SafetensorsDir(resaved_model), SafetensorsDir(work / "hf_back" / RESAVED)
    assert set(back.shapes()) == set(original.shapes())
    assert all(n.startswith(("model.language_model.", "lm_head.")) for n in original.shapes())
    differ = [n for n in original.shapes() if not hf_tiny.same_bits(back.read(n), original.read(n))]
    assert not differ, differ
    records = rank_checks.score_records_for_tests(read_hf_config(resaved_model).vocab_size)
    reference = transformers_loglik(resaved_model, records)
    for source in ("megatron", "hf"):
        for scored in (r["results"] for r in rank_checks.result(results, ("score", RESAVED, source))):
            assert_agrees(scored, reference)
