"""DeepSeek sparse attention: GLM-5 (``glm_moe_dsa``) and DeepSeek-V3.2 (``deepseek_v32``), ``model.dsa``.

Tiny random models built with transformers 5.19 (``hf_tiny.DSA_VARIANTS``: DeepSeek-V3's tiny MLA and sigmoid router,
an indexer of 4 heads choosing 4 keys per query out of 12 tokens; GLM-5 with plain RoPE and an interleaved indexer
RoPE, DeepSeek-V3.2 with YaRN and a half-split one). Without megatron: the configs read (and refuse what is not mapped,
by name), and transformers-only controls that the sparse choice moves the logits by far more than the 1e-4 the checks
below allow (so a Megatron model attending densely would fail them).

On megatron-core 0.19.2, one launch of 2 gloo ranks (``_cases``) checks for each model: logits equal transformers'
(fp32, <= 1e-4) at world 1 (two replicas, weights from a dict), TP2 (+SP: megatron's absorbed MLA requires it), PP2,
EP2 and TP2 x EP2; a control with the indexer's RoPE layout flipped differs (so the indexer's RoPE is exercised); the
export and each stage's weight-sync stream are the files bit for bit (indexer included); HF -> Megatron -> HF under
two layouts is bit for bit; ``score`` on the HF dir and the converted checkpoint equals transformers. The GSPO update
step under TP2, EP2, PP2 and TP2 x EP2 equals world 1's (test_family_steps' step), GRPO + Routing Replay replays every
route at TP2 x EP2, and the indexer leaves the step as it came (frozen: ``dsa.freeze_indexer``). On megatron-core
0.16.1 the launch does not run: the models are refused by name before anything is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gspo_megatron.model.errors import UnsupportedModel
from gspo_megatron.model.hf_config import read_hf_config
from gspo_megatron.model.hf_files import SafetensorsDir
from gspo_megatron.model.layout_check import LayoutError, check_layout
from gspo_megatron.parallel.groups import Layout
from tests.model import hf_tiny, rank_checks

ATOL = 1e-4
MATTERS = 1e-2
VARIANTS = tuple(hf_tiny.DSA_VARIANTS)
TP2_SP = Layout(tensor=2, sequence_parallel=True)
MIXED = Layout(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True)
BRIDGE_LAYOUTS = {"tp1_dict": Layout(), "tp2": TP2_SP, "pp2": Layout(pipeline=2), "ep2": Layout(expert=2),
                  "tp2_ep2_etp1": MIXED}
CONVERT_LAYOUTS = {"glm_moe_dsa": (MIXED, Layout(pipeline=2)), "deepseek_v32": (Layout(pipeline=2), TP2_SP)}
STEP_LAYOUTS = {"tp2": TP2_SP, "ep2": Layout(expert=2), "pp2": Layout(pipeline=2), "tp2_ep2": MIXED}
INDEXER = ".self_attn.indexer."


@pytest.fixture(scope="module")
def dsa_models(tmp_path_factory):
    directory = tmp_path_factory.getbasetemp() / "dsa_models"
    return {v: hf_tiny.save_variant(v, directory, seed=40 + i) for i, v in enumerate(VARIANTS)}


def _megatron_has_dsa() -> bool:
    from gspo_megatron.model.dsa import megatron_has_dsa

    return megatron_has_dsa()


def test_configs_read_and_refused_by_name(dsa_models):
    glm, v32 = (read_hf_config(dsa_models[v]) for v in VARIANTS)
    for spec in (glm, v32):
        assert spec.attention == "mla" and spec.q_lora_rank == 24 and spec.moe_router == "sigmoid"
        assert (spec.dsa_index_heads, spec.dsa_index_head_dim, spec.dsa_index_topk) == (4, 16, 4)
        assert spec.moe_layers == (False, True) and spec.head_dim == 16  # nope 8 + rope 8 (config head_dim: 8)
    assert glm.dsa_indexer_rope_interleaved and not v32.dsa_indexer_rope_interleaved
    assert glm.yarn_factor is None and v32.yarn_factor == 4.0
    config = json.loads((dsa_models["glm_moe_dsa"] / "config.json").read_text())
    assert not read_hf_config({**config, "indexer_rope_interleave": False}).dsa_indexer_rope_interleaved
    for change, field in ((dict(q_lora_rank=None), "q_lora_rank=None"),
                          (dict(indexer_types=["full", "shared"]), "indexer_types"),
                          (dict(index_topk_freq=2), "indexer_types"),
                          (dict(mlp_layer_types=["sparse", "sparse"]), "mlp_layer_types"),
                          (dict(index_head_dim=4), "index_head_dim=4"),
                          (dict(layer_types=["indexed_attention", "sliding_attention"]), "layer_types")):
        with pytest.raises(UnsupportedModel, match=field):
            read_hf_config({**config, **change})


@torch.no_grad()
@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_models_sparse_choice_moves_the_logits(variant, dsa_models):
    """With every key kept (index_topk = the sequence) the logits move by far more than 1e-4: the checks against
    transformers see the sparse choice. And the first index_topk queries, which keep all their keys either way, do
    not move in the first layer's output (the choice is causal: it never reaches ahead)."""
    model = hf_tiny.load_hf_model(dsa_models[variant])
    reference = torch.load(dsa_models[variant].parent / f"{variant}.reference.pt")
    tokens = reference["tokens"]
    assert model.config.index_topk < tokens.shape[1]
    assert (model(tokens).logits - reference["logits"]).abs().max() <= 1e-5
    indexers = [layer.self_attn.indexer for layer in model.model.layers]
    for indexer in indexers:
        indexer.index_topk = tokens.shape[1]
    dense = model(tokens).logits
    assert (dense - reference["logits"]).abs().max() > MATTERS, "the sparse choice does not matter"
    first = model.config.index_topk
    assert (dense[:, :first] - reference["logits"][:, :first]).abs().max() <= 1e-5


@pytest.mark.megatron  # what it accepts depends on megatron-core's version
def test_refused_by_name_before_anything_is_built_on_megatron_without_dsa(dsa_models):
    """megatron-core 0.16.1 has an early DSA whose indexer always applies a bf16-only Hadamard rotation and
    half-split RoPE: the layout check (convert, score, the model build) and ``train``'s pre-flight refuse both
    families there, naming the version; 0.19.2 accepts them, and refuses TP without sequence parallelism by name."""
    from gspo_megatron.train.startup.config import ConfigError
    from gspo_megatron.train.startup.validate import validate_megatron

    for variant in VARIANTS:
        spec = read_hf_config(dsa_models[variant])
        config = json.loads((dsa_models[variant] / "config.json").read_text())
        if not _megatron_has_dsa():
            with pytest.raises(LayoutError, match=rf"model_type={variant} needs DeepSeek sparse attention .* 0\.16\.1"):
                check_layout(spec, Layout())
            with pytest.raises(ConfigError, match=rf"model_type={variant} needs DeepSeek sparse attention .*0\.16\.1"):
                validate_megatron(config)
            continue
        check_layout(spec, MIXED)
        validate_megatron(config)
        with pytest.raises(LayoutError, match="sparse attention .* needs sequence parallelism under TP"):
            check_layout(spec, Layout(tensor=2))


# ---- the launch (megatron-core 0.19.2) ----------------------------------------------------------------------------

def _cases(models: dict, work: Path) -> list:
    cases = []
    for name, path in models.items():
        for kind, layout in BRIDGE_LAYOUTS.items():
            source = "dict" if kind == "tp1_dict" else "dir"
            cases.append((("bridge", name, kind), rank_checks.bridge_case, (str(path), layout, source), layout))
        flipped = not read_hf_config(path).dsa_indexer_rope_interleaved
        cases.append((("bridge", name, "rope_flipped"), _flipped_rope_case, (str(path), flipped), Layout()))
        there, back = CONVERT_LAYOUTS[name]
        megatron_dir = str(work / "megatron" / name)
        cases.append((("to_megatron", name), rank_checks.to_megatron_case, (str(path), megatron_dir, there), there))
        cases.append((("to_hf", name), rank_checks.to_hf_case, (megatron_dir, str(work / "hf_back" / name), str(path),
                                                                  back), back))
        vocab = read_hf_config(path).vocab_size
        cases.append((("score", name, "megatron"), rank_checks.score_case, (megatron_dir, back, vocab), back))
        cases.append((("score", name, "hf"), rank_checks.score_case, (str(path), there, vocab), there))
    return rank_checks.in_run_order(cases)


def _flipped_rope_case(hf_dir: str, interleaved: bool) -> dict:
    return rank_checks.bridge_case(hf_dir, Layout(), "dir", dsa_indexer_rope_interleaved=interleaved)


def _launch(models: dict, work: str, rollouts: dict) -> dict:
    """Every 2-rank check of this module, on each rank: the bridge / conversion / score cases, then the update steps."""
    from tests.train.update.test_family_steps import step_case

    results = rank_checks.run_cases(_cases(models, Path(work)))
    for kind, layout in STEP_LAYOUTS.items():
        for name, path in models.items():
            results[("step", name, kind)] = step_case(str(path), layout, rollouts[name])
    for name, path in models.items():
        results[("step", name, "tp2_ep2", "grpo_rr")] = step_case(str(path), MIXED, rollouts[name], "grpo_rr")
    return results


def _world1(models: dict) -> dict:
    from tests.train.update.test_family_steps import reference

    return reference({name: str(path) for name, path in models.items()})


@pytest.fixture(scope="module")
def dsa_results(dsa_models, tmp_path_factory):
    from gspo_megatron.parallel.launch import run_on_ranks

    if not _megatron_has_dsa():
        pytest.skip("megatron-core 0.16.1 refuses these models (test_refused_by_name_before_anything_is_built...)")
    work = tmp_path_factory.mktemp("dsa_work")
    (world1,) = run_on_ranks(_world1, 1, Layout(), dsa_models, timeout=300)
    per_rank = run_on_ranks(_launch, 2, None, dsa_models, str(work),
                            {name: r["rollout"] for name, r in world1.items()}, timeout=480)
    return per_rank, world1, work


@pytest.mark.megatron  # builds Megatron models
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers_and_export_is_bitwise(variant, dsa_models, dsa_results):
    results, _, _ = dsa_results
    names = set(SafetensorsDir(dsa_models[variant]).shapes())
    assert sum(INDEXER in n for n in names) == 2 * 5  # wq_b, wk, k_norm weight and bias, weights_proj per layer
    for kind in BRIDGE_LAYOUTS:
        rank_checks.assert_bridge_layout(results, ("bridge", variant, kind), ATOL, "AbsorbedMLASelfAttention", names)
    flipped = [r["logits_diff"] for r in rank_checks.result(results, ("bridge", variant, "rope_flipped"))]
    assert min(flipped) > MATTERS, f"the indexer's RoPE layout does not matter ({min(flipped):.1e})"


@pytest.mark.megatron  # converts through Megatron models
@pytest.mark.parametrize("variant", VARIANTS)
def test_conversion_round_trip_is_bitwise(variant, dsa_models, dsa_results):
    _, _, work = dsa_results
    original, back = SafetensorsDir(dsa_models[variant]), SafetensorsDir(work / "hf_back" / variant)
    assert set(back.shapes()) == set(original.shapes())
    differ = [n for n in original.shapes() if not hf_tiny.same_bits(back.read(n), original.read(n))]
    assert not differ, differ
    config = json.loads((work / "hf_back" / variant / "config.json").read_text())
    assert config["model_type"] == variant and config["index_topk"] == 4


@pytest.mark.megatron  # checks the Megatron model's results
@pytest.mark.parametrize("variant", VARIANTS)
def test_score_equals_transformers_on_the_hf_dir_and_the_converted_checkpoint(variant, dsa_models, dsa_results):
    from tests.tools.test_score import assert_agrees, transformers_loglik

    results, _, _ = dsa_results
    records = rank_checks.score_records_for_tests(read_hf_config(dsa_models[variant]).vocab_size)
    reference = transformers_loglik(dsa_models[variant], records)
    for source in ("megatron", "hf"):
        per_rank = rank_checks.result(results, ("score", variant, source))
        assert per_rank[0]["megatron_checkpoint"] == (source == "megatron")
        for scored in (r["results"] for r in per_rank):
            assert_agrees(scored, reference)


@pytest.mark.megatron  # checks the Megatron model's results
@pytest.mark.parametrize("variant, kind", [(v, k) for k in STEP_LAYOUTS for v in VARIANTS])
def test_update_step_equals_world1_and_leaves_the_indexer_frozen(variant, kind, dsa_models, dsa_results):
    """test_family_steps' GSPO step (SGD lr 1 on 8 sequences) under each layout equals world 1's; the indexer's
    weights come out of the step bit for bit as loaded (world 1 too), while every other weight moved."""
    from tests.train.update.test_family_steps import _assert_same_loss, _assert_same_weights

    results, world1, _ = dsa_results
    expected, original = world1[variant], SafetensorsDir(dsa_models[variant])
    frozen = [n for n in expected["exported"] if INDEXER in n]
    assert len(frozen) == 10 and all(hf_tiny.same_bits(expected["exported"][n], original.read(n)) for n in frozen)
    moved = max((expected["exported"][n] - original.read(n)).abs().max().item() for n in expected["exported"])
    assert moved > 1e-3, f"the reference step moved no weight by more than {moved:.1e}"
    exported = {}
    for rank, r in enumerate(rank_checks.result(results, ("step", variant, kind))):
        _assert_same_loss(variant, r, expected, rank)
        exported.update(r["exported"])
    _assert_same_weights(exported, expected["exported"], original, 0.0)
    assert all(hf_tiny.same_bits(exported[n], original.read(n)) for n in frozen), "the indexer moved"


@pytest.mark.megatron  # checks the Megatron model's results
@pytest.mark.parametrize("variant", VARIANTS)
def test_grpo_routing_replay_replays_every_route(variant, dsa_models, dsa_results):
    from tests.train.update.test_family_steps import _assert_same_loss, _assert_same_weights

    results, world1, _ = dsa_results
    expected = world1[variant]["grpo_rr"]
    runs = [expected, *rank_checks.result(results, ("step", variant, "tp2_ep2", "grpo_rr"))]
    for i, r in enumerate(runs):
        assert r["routes_total"] > 0 and r["routes_same"] == r["routes_total"], (i, r["routes_same"])
        assert r["changed"] > 0.2, f"run {i}: the drift changed only {r['changed']:.0%} of the routes"
    exported = {}
    for rank, r in enumerate(runs[1:]):
        _assert_same_loss(variant, r, expected, rank)
        exported.update(r["exported"])
    _assert_same_weights(exported, expected["exported"], SafetensorsDir(dsa_models[variant]), 0.0)
