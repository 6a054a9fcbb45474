"""``plan``'s memory model: what each setting changes, by hand, and against measured peaks of real CPU steps.

The measurement (``plan.probe``) runs the loop's own path on Megatron-Core over gloo (build_policy, the
old-policy pass, two update steps) and counts live tensor bytes; the estimate for megatron's local spec must be
within PEAK_RTOL of the measured steady-state peak, and within ABOVE_STATE_RTOL for the part above the training
state (activations and working set: what the layout, sequence length and recompute change). Measured by
bench/plan_memory.py over more layouts and lengths: peaks agree within ~3% (bench/RESULTS.md); expert-parallel
ranks differ by up to ~5% from the balanced-routing estimate, since random routing is not balanced.
"""

from __future__ import annotations

import pytest

from gspo_megatron.model.hf_config import read_hf_config
from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.train.startup.config import load_config
from gspo_megatron.plan.memory import GIB, estimate_memory, padded_length
from gspo_megatron.plan.probe import compare_with_plan, measure_layouts

PEAK_RTOL = 0.10
ABOVE_STATE_RTOL = 0.15

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    vocab_size=151936, tie_word_embeddings=False,
)
SPEC = read_hf_config(QWEN3_30B_A3B)
BF16 = ["data.task=count", "model.dtype=bfloat16", "rollout.max_prompt_tokens=1024", "rollout.max_new_tokens=3072",
        "rollout.prompts_per_step=32", "rollout.group_size=16"]


def estimate(world: int, *overrides: str, impl: str = "te"):
    return estimate_memory(SPEC, load_config(None, BF16 + list(overrides)), world, impl=impl)


def test_routed_tokens_per_rank_do_not_shrink_with_expert_parallelism():
    # Each rank routes its N/sp tokens to top-k experts; the all-to-all spreads them, it does not divide them.
    ep8 = estimate(16, "parallel.tensor=2", "parallel.expert=8", "parallel.expert_tensor=1").worst
    ep16 = estimate(16, "parallel.tensor=2", "parallel.expert=16", "parallel.expert_tensor=1").worst
    tokens = 4096 / 2  # N / sp under TP=2 with sequence parallelism, micro batch 1
    expected = 48 * 8 * tokens * 2 * 2048  # MoE layers x top-k x tokens x bf16 x hidden
    assert ep8.activation_terms["mlp.routed_tokens"] == pytest.approx(expected)
    assert ep16.activation_terms["mlp.routed_tokens"] == pytest.approx(expected)
    # Per routed token the experts keep 6 x moe_ffn elements (fc1 out 2f, silu, linear half + offset, GLU, GLU x p).
    assert ep8.activation_terms["mlp.experts"] == pytest.approx(48 * 8 * tokens * 2 * 6 * 768)
    # Expert weights shrink; their distributed optimizer state is spread over all ranks of a stage either way
    # (EP x expert-DP = world / PP).
    assert ep16.params < ep8.params and ep16.optimizer == pytest.approx(ep8.optimizer)


def test_packed_micro_batches():
    """A packed micro batch is one row: micro_batch_size rows' tokens (the same activations under TE, whose
    attention keeps no score matrix; within 1% from terms per sequence), or the token budget."""
    padded = estimate(8, "parallel.expert=8", "parallel.micro_batch_size=2")
    packed = estimate(8, "parallel.expert=8", "parallel.micro_batch_size=2", "parallel.pack_sequences=true")
    budget = estimate(8, "parallel.expert=8", "parallel.pack_sequences=true",
                      f"parallel.max_tokens_per_micro_batch={2 * 4096}")
    assert packed.seq_len == budget.seq_len == 2 * 4096 and padded.seq_len == 4096
    assert packed.worst.activations == pytest.approx(padded.worst.activations, rel=0.01)
    assert budget.worst.activations == pytest.approx(packed.worst.activations)
    assert budget.micro_batches == 2 * packed.micro_batches  # at most one per sequence
    # The unfused local attention's scores grow with the row: [N, N] per head.
    local = [estimate(8, "parallel.expert=8", "parallel.micro_batch_size=2", *extra, impl="local").worst
             for extra in ((), ("parallel.pack_sequences=true",))]
    assert local[1].activations > local[0].activations


def test_recompute_settings():
    none = estimate(8, "parallel.expert=8", "recompute.granularity=none").worst
    moe = estimate(8, "parallel.expert=8", "recompute.granularity=selective", "recompute.modules=[moe]").worst
    full = estimate(8, "parallel.expert=8", "recompute.granularity=full").worst
    assert "mlp.experts" in none.activation_terms and "mlp.experts" not in moe.activation_terms
    assert none.activations > moe.activations > full.activations
    # Full recompute keeps each layer's input only, and re-creates one layer in backward.
    assert full.activation_terms == {"recompute_inputs": pytest.approx(48 * 4096 * 2 * 2048),
                                     "final_norm": pytest.approx(full.activation_terms["final_norm"])}
    assert full.working >= sum(none.activation_terms.values()) / 48 * 0.5
    # Flash attention keeps no [s, s] scores: core_attn recompute saves only its fp32 log-sum-exp (TE);
    # megatron's local attention keeps them unless core_attn is recomputed.
    core_attn = ["recompute.granularity=selective", "recompute.modules=[core_attn]"]
    te = [estimate(8, "parallel.expert=8", *r).worst.activations for r in (core_attn, ["recompute.granularity=none"])]
    local = [estimate(8, "parallel.expert=8", *r, impl="local").worst.activations
             for r in (core_attn, ["recompute.granularity=none"])]
    assert te[1] / te[0] < 1.01 and local[1] / local[0] > 1.5


def test_kl_reference_and_pipeline_in_flight():
    assert estimate(8, "parallel.expert=8").worst.reference == 0
    with_kl = estimate(8, "parallel.expert=8", "algo.kl_coef=0.01").worst
    assert with_kl.reference == with_kl.params
    # 32 x 16 / 4 minibatches / DP 8 = 16 micro batches of 1 per DP rank: 1F1B keeps PP - stage of them.
    stages = estimate(32, "parallel.expert=8", "parallel.pipeline=2", "parallel.tensor=2").stages
    assert [(s.stage, s.micro_batches_in_flight) for s in stages] == [("first", 2), ("last", 1)]
    assert stages[0].activations == pytest.approx(2 * sum(stages[0].activation_terms.values()))


def test_padded_length_and_total():
    cfg = load_config(None, BF16 + ["rollout.max_new_tokens=3071", "parallel.tensor=4"])
    assert padded_length(cfg) == 4096  # 1024 + 3071, up to a multiple of TP (the batcher's padding)
    e = estimate(8, "parallel.expert=8")
    assert e.total_bytes == pytest.approx(e.worst.tensors * 1.05 + 3 * GIB)


# ---- against measurement ---------------------------------------------------------------------------

MODEL = dict(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, num_experts=4,
             top_k=2, moe_intermediate_size=128, max_position_embeddings=1024)
SMALL = ["data.task=reverse", "model.dtype=bfloat16", "rollout.prompts_per_step=2", "rollout.group_size=4",
         "algo.minibatches=2", "parallel.micro_batch_size=2"]
LAYOUTS = [["parallel.tensor=2"], ["parallel.expert=2"]]
SEQ = 256


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from gspo_megatron.rollout.synthetic import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("plan_memory") / "model", seed=0, **MODEL))


@pytest.mark.megatron  # builds a Megatron model
def test_estimate_matches_measured_peaks(tiny_dir):
    configs = [load_config(None, SMALL + layout + [f"model.hf_dir={tiny_dir}"]) for layout in LAYOUTS]
    per_rank = run_on_ranks(measure_layouts, 2, None, [(cfg, SEQ) for cfg in configs], tiny_dir)
    for i, cfg in enumerate(configs):
        for row in compare_with_plan(cfg, 2, SEQ, tiny_dir, [rank[i] for rank in per_rank])["rows"]:
            where = f"{LAYOUTS[i]}: {row}"
            assert abs(row["peak_ratio"] - 1) <= PEAK_RTOL, where
            assert abs(row["above_state_ratio"] - 1) <= ABOVE_STATE_RTOL, where
            # The activations are a real part of what is compared, not noise on top of the weights.
            assert row["plan_above_state"] > 0.2 * row["plan_peak"], where
