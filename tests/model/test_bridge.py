"""The Megatron policy built from HF models equals ``transformers``, under every layout, on gloo ranks.

For every tiny family (``hf_tiny.VARIANTS``): build the Megatron model, load the HF weights through the
bridge, run the forward through Megatron's schedule and compare the (TP-gathered) logits with the logits
``transformers`` computed from the same weights: max |diff| <= 1e-4 (fp32; measured ~2e-6). Layouts: TP=1
(two data-parallel replicas, weights from an in-memory dict), TP=2 (+ sequence parallel for MoE), PP=2 (uneven
for the three-layer Moonlight: its dense first layer alone on stage 0, megatron's num_layers_in_first_pipeline_stage),
EP=2 and TP=2 x EP=2 with expert-TP=1 (MoE). On every rank the bridge's export reproduces each HF tensor
bit for bit, and the stages' exports together are the whole checkpoint. A control loads q/k/v in a plain
(not per-group) layout and must *fail* the tolerance, so the comparison can tell layouts apart (not for the
multi-latent-attention variants, which have no fused q/k/v; their MTP tensors are carried by conversion, not the
bridge). For GLM-4.5 a transformers-only check shows its group limit and expert bias change the experts chosen.
The weight-sync export (``export_to_sender``) yields the same tensors bit for bit on each pipeline stage's first
rank only, through gathers (never all-gathers) that only the ranks holding the sender's shards join.
(Cases: ``rank_checks.bridge_cases``.)
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.model import mapping
from gspo_megatron.model.hf_config import read_hf_config
from gspo_megatron.model.hf_files import SafetensorsDir
from tests.model import hf_tiny, rank_checks

ATOL = 1e-4
LAYOUTS = ["tp1_dict", "tp2", "pp2", "ep2", "tp2_ep2_etp1"]
DENSE_LAYOUTS = LAYOUTS[:3]


@pytest.mark.megatron  # builds a Megatron model
@pytest.mark.parametrize("variant", list(hf_tiny.VARIANTS))
def test_megatron_logits_equal_transformers_and_export_is_bitwise(variant, hf_models, rank_results):
    spec = read_hf_config(hf_models[variant])
    # MTP layers are not part of the policy: conversion carries them (tests/tools/test_convert.py), the bridge does not
    all_names = {n for n in SafetensorsDir(hf_models[variant]).shapes() if mapping.mtp_layer_of(spec, n) is None}
    kinds = LAYOUTS if variant in hf_tiny.MOE_VARIANTS else DENSE_LAYOUTS
    for kind in kinds:
        per_rank = rank_checks.result(rank_results, ("bridge", variant, kind))
        diffs = [r["logits_diff"] for r in per_rank if "logits_diff" in r]
        assert diffs, f"{kind}: no rank computed logits"
        assert max(diffs) <= ATOL, f"{kind}: logits differ by {max(diffs):.2e} > {ATOL}"
        assert all(r["padding_logits"] == 0.0 for r in per_rank if "padding_logits" in r), kind
        for rank, r in enumerate(per_rank):
            assert not r["not_bitwise"], f"{kind} rank {rank}: export differs for {r['not_bitwise']}"
            assert r["export_names_match"], f"{kind} rank {rank}: export_names() disagrees with the export"
            assert len(r["exported"]) == len(set(r["exported"])), f"{kind} rank {rank}: a tensor exported twice"
        _check_export_to_sender(kind, per_rank, variant in hf_tiny.MOE_VARIANTS)
        exported = [set(r["exported"]) for r in per_rank]
        if kind == "pp2":  # each stage its own tensors and layers (uneven for three layers); together the whole
            assert exported[0].isdisjoint(exported[1]) and exported[0] | exported[1] == all_names, kind
            layout = rank_checks.pp2_layout(hf_models[variant])
            for stage, names in enumerate(exported):
                layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
                assert layers == set(layout.stage_range(spec.num_layers, stage)), (stage, sorted(layers))
        else:  # TP / EP / DP: every rank yields the whole (gathered) checkpoint
            assert all(e == all_names for e in exported), kind


@pytest.mark.megatron  # builds a Megatron model, or is refused one on megatron-core 0.16.1
@pytest.mark.parametrize("kind", ["tp1_fused", "tp2_fused"])
def test_fused_mla_down_projection_maps_or_is_refused(kind, hf_models, rank_results):
    """megatron's ``mla_down_proj_fusion`` (0.19): one ``linear_qkv_down_proj`` [q_lora + kv_lora + rope, hidden]
    holding HF's q_a_proj and kv_a_proj_with_mqa (each rank [q_r; kv_r] at TP2) gives transformers' logits and
    exports bit for bit; megatron-core 0.16.1, which lacks the field, refuses it by name."""
    from gspo_megatron.model.mla import megatron_has_down_proj_fusion

    per_rank = rank_checks.result(rank_results, ("bridge", "deepseek_v3", kind))
    if not megatron_has_down_proj_fusion():
        for r in per_rank:
            assert r["refused"] and "model.mla_down_proj_fusion" in r["refused"] and "0.16.1" in r["refused"], r
        return
    spec = read_hf_config(hf_models["deepseek_v3"])
    tp = 2 if kind == "tp2_fused" else 1
    fused = spec.q_lora_rank + spec.kv_lora_rank + spec.qk_rope_head_dim
    for rank, r in enumerate(per_rank):
        assert r["attention_class"] == "FusedMLASelfAttention", r["attention_class"]
        assert r["attention"]["decoder.layers.0.self_attention.linear_qkv_down_proj.weight"] == (
            fused // tp, spec.hidden_size), r["attention"]
        assert not any("linear_q_down_proj" in n or "linear_kv_down_proj" in n for n in r["attention"]), r["attention"]
        assert r["logits_diff"] <= ATOL, f"{kind}: logits differ by {r['logits_diff']:.2e} > {ATOL}"
        assert not r["not_bitwise"] and not r["to_sender_not_bitwise"], f"{kind} rank {rank}: {r['not_bitwise']}"
        assert r["export_names_match"]
    unfused = rank_checks.result(rank_results, ("bridge", "deepseek_v3", "tp2" if tp == 2 else "tp1_dict"))
    assert [sorted(r["exported"]) for r in per_rank] == [sorted(r["exported"]) for r in unfused], (
        "the fused model exports other tensors")


@pytest.mark.megatron  # loads dist checkpoints into Megatron models
def test_fused_mla_down_projection_shares_the_separate_layouts_checkpoints(hf_models, rank_results):
    """A checkpoint converted with separate down projections (PP2) loads into the fused model at TP2, and the
    fused model's own checkpoint loads back into a separate one: both export the HF files bit for bit."""
    per_rank = rank_checks.result(rank_results, ("to_hf", "deepseek_v3_fused"))
    if per_rank[0] == {"refused": True}:
        return  # megatron-core 0.16.1: no fusion (test_fused_mla_down_projection_maps_or_is_refused)
    spec = read_hf_config(hf_models["deepseek_v3"])
    names = sorted(n for n in SafetensorsDir(hf_models["deepseek_v3"]).shapes() if mapping.mtp_layer_of(spec, n) is None)
    for rank, r in enumerate(per_rank):
        for way in ("into_fused", "from_fused"):
            assert r[way]["names"] == names and not r[way]["not_bitwise"], (rank, way, r[way]["not_bitwise"])


# Which of the two ranks gathers to rank 0 in each layout (rank 1's role).
RANK1_JOINS_GATHERS = {"tp1_dict": False, "tp2": True, "pp2": False, "ep2": "moe", "tp2_ep2_etp1": True}


def _check_export_to_sender(kind, per_rank, moe):
    senders = [r["sender"] for r in per_rank]
    assert senders == ([True, True] if kind == "pp2" else [True, False]), (kind, senders)
    for rank, r in enumerate(per_rank):
        where = f"{kind} rank {rank}"
        assert r["to_sender"] == (r["exported"] if r["sender"] else []), where
        assert not r["to_sender_not_bitwise"], where
        assert r["to_sender_collectives"]["all_gather"] == 0, where
    joins = RANK1_JOINS_GATHERS[kind]
    joins = moe if joins == "moe" else joins  # EP=2: rank 1 sends its experts, not its dense replica
    assert (per_rank[1]["to_sender_collectives"]["gather"] > 0) == joins, (kind, per_rank[1]["to_sender_collectives"])


@pytest.mark.megatron  # checks the Megatron model's results (a session fixture built it)
@pytest.mark.parametrize("variant", [v for v in hf_tiny.VARIANTS if v not in hf_tiny.MLA_VARIANTS])
def test_a_wrong_qkv_layout_is_detected(variant, rank_results):
    diffs = [r["logits_diff"] for r in rank_checks.result(rank_results, ("bridge", variant, "control"))]
    assert min(diffs) > 1e-2, f"q/k/v stacked without grouping still matched transformers ({min(diffs):.2e})"


@torch.no_grad()
def test_tiny_glm_routing_depends_on_its_group_limit_and_bias(hf_models):
    """The tiny GLM model's group limit and expert bias really change which experts transformers picks, so the
    logits comparison above would catch a bridge that dropped either (transformers only, no Megatron)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_models["glm4_moe"], dtype=torch.float32)
    gate = model.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.abs().min() > 0
    hidden = torch.randn(64, gate.hidden_dim, generator=torch.Generator().manual_seed(0))

    def chosen():
        return gate(hidden)[2].sort(dim=-1).values

    grouped = chosen()
    gate.num_group, gate.topk_group = 1, 1
    assert (chosen() != grouped).any(dim=-1).sum() >= 8, "the group limit changes fewer than 8 of 64 tokens' experts"
    gate.num_group, gate.topk_group = 4, 2
    gate.e_score_correction_bias.zero_()
    assert (chosen() != grouped).any(dim=-1).sum() >= 8, "the bias changes fewer than 8 of 64 tokens' experts"
