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
and MTP tensors carried; and packed sequences (``parallel.pack_sequences``) of Qwen3.5-MoE equal the padded run at
world 1, TP2 and PP2, each sequence's DeltaNet state fresh. Context parallelism is refused by name.
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
        if name == MOE:  # Qwen3-Next's DeltaNet is the same module
            for kind, layout in PACKED_LAYOUTS.items():
                cases.append((("packed", name, kind), packed_case, (str(path), layout), layout))
    return rank_checks.in_run_order(cases)


# ---- packed sequences through the DeltaNet (parallel.pack_sequences) ----

# Four sequences in micro batches of two; 70 tokens crosses the rule's 64-token chunk, and the packed rows (79 and 63
# tokens, + rounding under TP) put segment starts inside chunks. Garbage after each sequence's end.
PACKED_LENGTHS, PACKED_WIDTH = (70, 9, 23, 40), 72
# PP2: stage 0 holds DeltaNet layers only (no core attention to tell the packing by: schedule_packing)
PACKED_LAYOUTS = {"world1": Layout(), "tp2": TP2_SP, "pp2": Layout(pipeline=2)}
# fp32: RoPE turns by the packed row's positions (scores equal up to rounding), as tests/train/update/test_packing.py
LOGPROB_ATOL, LOSS_ATOL, GRAD_RTOL = 2e-5, 1e-6, 1e-5


def _packed_rollout(vocab: int) -> list[dict]:
    from gspo_megatron.algo import group_advantages

    g = torch.Generator().manual_seed(11)
    n = len(PACKED_LENGTHS)
    tokens = torch.randint(0, vocab, (n, PACKED_WIDTH + 1), generator=g)
    lengths = torch.tensor(PACKED_LENGTHS)
    t = torch.arange(PACKED_WIDTH).unsqueeze(0)
    loss_mask = (t + 1 >= 3) & (t + 1 < lengths.unsqueeze(1))
    rollout = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask, "seq_lengths": lengths,
               "advantages": group_advantages(torch.rand(n, generator=g), 2)}
    return [{k: v[i:i + 2] for k, v in rollout.items()} for i in range(0, n, 2)]


def _fresh_state_per_segment(model) -> dict:
    """The first DeltaNet layer on a packed row with the local attention's block-diagonal mask, against each segment
    run alone, and against the whole row as one sequence (which must differ: the reset is what is tested)."""
    from gspo_megatron.parallel import packing

    deltanet = model.decoder.layers[0].self_attention
    offsets = torch.tensor([0, 50, 51, 90, 96])
    hidden = torch.randn(96, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed = deltanet(hidden, packing.block_causal_mask(offsets, 96))[0]
        alone = torch.cat([deltanet(hidden[s:e], None)[0] for s, e in zip(offsets[:-1], offsets[1:])])
        whole = deltanet(hidden, None)[0]
    return {"segments_diff": (packed - alone).abs().max().item(), "whole_diff": (packed - whole).abs().max().item()}


def packed_case(hf_dir: str, layout: Layout) -> dict:
    """Padded vs packed on one model (the local spec: the block-diagonal mask path): the log-prob pass and a GSPO
    update (lr 0), through the trainer's passes."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.process_groups import ensure_model_parallel
    from gspo_megatron.model.provider import build_gpt_model
    from gspo_megatron.train.update.loss import LossConfig
    from gspo_megatron.train.update.schedules import logprob_pass, update_step
    from tests import megatron_tiny as tiny

    ensure_model_parallel(layout)
    spec = read_hf_config(hf_dir)
    model = build_gpt_model(spec, layout)
    Bridge(spec).load_hf_weights(model, hf_dir)
    result = _fresh_state_per_segment(model) if layout.tensor == 1 else {}
    ddp = tiny.wrap_ddp(model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.0, clip_grad=1.0), [ddp])
    micro = _packed_rollout(spec.vocab_size)
    passes = {pack: logprob_pass(ddp, micro, pack=pack) for pack in (False, True)}
    real = torch.arange(PACKED_WIDTH).unsqueeze(0) < torch.tensor(PACKED_LENGTHS).unsqueeze(1)
    result["logprobs_diff"] = (passes[True]["logprobs"] - passes[False]["logprobs"])[real].abs().max().item()
    noise = 1e-3 * torch.randn(real.shape, generator=torch.Generator().manual_seed(3))
    old = passes[False]["logprobs"].cpu() + noise
    for i, mb in enumerate(micro):
        mb["old_logprobs"] = old[2 * i:2 * i + 2]
    steps = {}
    for pack in (False, True):
        out = update_step(ddp, optimizer, micro, LossConfig(eps_low=3e-4, eps_high=4e-4), pack=pack)
        steps[pack] = out, tiny.flat(tiny.grads_sharded_state_dict(ddp.module))
    (out, grads), (padded, padded_grads) = steps[True], steps[False]
    result.update(loss_diff=abs(out["loss"].item() - padded["loss"].item()),
                  grad_norm_diff=abs(out["grad_norm"] - padded["grad_norm"]) / padded["grad_norm"],
                  grads_diff=max(tiny.max_rel_diff(grads[k], padded_grads[k]) for k in padded_grads),
                  deltanet_grads=sum(".self_attention.in_proj." in k for k in padded_grads))
    return result


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


def test_context_parallelism_is_refused_by_name(hybrid_models):
    """The DeltaNet under context parallelism is refused before the model is built, even where TransformerEngine's
    attention could split the full-attention layers: 0.16.1's DeltaNet would treat each rank's chunks as whole
    sequences, and 0.19.2's all-to-all path is not tested here."""
    spec = read_hf_config(hybrid_models[MOE])
    with pytest.raises(LayoutError, match="context_parallel_size=2: qwen3_5_moe_text's gated-DeltaNet layers"):
        check_layout(spec, Layout(context=2), transformer_engine=True)
    check_layout(spec, Layout(), transformer_engine=True)


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
        rank_checks.assert_bridge_layout(results, ("bridge", variant, kind), ATOL, "PackedGatedDeltaNet", trained)


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


@pytest.mark.megatron  # checks the Megatron model's results
def test_packed_sequences_equal_padded_with_a_fresh_deltanet_state_each(hybrid_results):
    """``parallel.pack_sequences`` through the DeltaNet (``model.gated_deltanet.PackedGatedDeltaNet``) of Qwen3.5-MoE
    (Qwen3-Next's is the same module): on the block-diagonal mask path each packed sequence's convolution and
    recurrent state start fresh, so the packed log-prob pass (2e-5 absolute on every real position), GSPO loss
    (1e-6), gradient norm and every gradient (1e-5 relative) equal the padded run's at world 1, TP2 + SP and PP2 (a
    stage of DeltaNet layers only). A stage's first DeltaNet layer on a packed row equals its segments run alone
    (1e-5), and differs from the row run as one sequence (the reset is what passes)."""
    results, _ = hybrid_results
    for kind in PACKED_LAYOUTS:
        for rank, r in enumerate(rank_checks.result(results, ("packed", MOE, kind))):
            where = (kind, rank, r)
            assert r["logprobs_diff"] <= LOGPROB_ATOL and r["loss_diff"] <= LOSS_ATOL, where
            assert r["grad_norm_diff"] <= GRAD_RTOL and r["grads_diff"] <= GRAD_RTOL and r["deltanet_grads"], where
            if kind != "tp2":
                assert r["segments_diff"] <= 1e-5 and r["whole_diff"] > 1e-3, where
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
