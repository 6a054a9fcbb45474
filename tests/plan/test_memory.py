"""``plan``'s memory model: what each setting changes, by hand, and against measured peaks of real CPU steps.

The measurement (``plan.probe``) runs the loop's own path on Megatron-Core over gloo (build_policy, the
old-policy pass, two update steps) and counts live tensor bytes; the estimate for megatron's local spec must be
within PEAK_RTOL of the measured steady-state peak, and within ABOVE_STATE_RTOL for the part above the training
state (activations and working set: what the layout, sequence length and recompute change), for a tiny Qwen3-MoE,
GLM-4.5 (a dense first layer, a shared expert) and DeepSeek-V3 (multi-latent attention, two shared experts).
Measured by bench/plan_memory.py over more layouts and lengths: peaks agree within ~3% (bench/RESULTS.md);
expert-parallel ranks differ by up to ~5% from the balanced-routing estimate, since random routing is not balanced.
The tiny GLM-4.5 and DeepSeek-V3 came within 2.6% at TP2 and EP2 (256 tokens) when these tests were written.
Multi-latent attention's TransformerEngine terms (what a GPU run builds) are counted by hand below, not measured.
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


def estimate(world: int, *overrides: str, impl: str = "te", spec=SPEC):
    return estimate_memory(spec, load_config(None, BF16 + list(overrides)), world, impl=impl)


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


def tiny_model(name: str, directory) -> str:
    """A tiny model directory: the CPU example's Qwen3-MoE, or a family variant of tests/model/hf_tiny.py."""
    from gspo_megatron.rewards.synthetic import save_tiny_model
    from tests.model import hf_tiny

    if name == "qwen3_moe":
        return str(save_tiny_model(directory / "model", seed=0, **MODEL))
    return str(hf_tiny.save_variant(name, directory))


@pytest.mark.megatron  # builds a Megatron model
@pytest.mark.parametrize("model", ["qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_estimate_matches_measured_peaks(model, tmp_path):
    tiny_dir = tiny_model(model, tmp_path)
    configs = [load_config(None, SMALL + layout + [f"model.hf_dir={tiny_dir}"]) for layout in LAYOUTS]
    per_rank = run_on_ranks(measure_layouts, 2, None, [(cfg, SEQ) for cfg in configs], tiny_dir)
    for i, cfg in enumerate(configs):
        for row in compare_with_plan(cfg, 2, SEQ, tiny_dir, [rank[i] for rank in per_rank])["rows"]:
            where = f"{LAYOUTS[i]}: {row}"
            assert abs(row["peak_ratio"] - 1) <= PEAK_RTOL, where
            assert abs(row["above_state_ratio"] - 1) <= ABOVE_STATE_RTOL, where
            # The activations are a real part of what is compared, not noise on top of the weights.
            assert row["plan_above_state"] > 0.2 * row["plan_peak"], where


# ---- multi-latent attention, shared experts, dense first layers, the rollout servers (the examples' models) ----

from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEEPSEEK_V3 = read_hf_config(ROOT / "examples/deepseek_v3_671b/hf_config/config.json")
GLM_4_5 = read_hf_config(ROOT / "examples/glm_4_5_355b/hf_config/config.json")


def test_mla_activations_by_hand():
    """DeepSeek-V3's attention block (TE spec), TP 8 with sequence parallelism, one 4096-token row, bf16."""
    from gspo_megatron.plan.memory import Micro, attention_transients, mla_activations

    m = Micro(s=4096, b=1, tp=8, sp=8, cp=1, etp=1, a=2)
    terms = mla_activations(DEEPSEEK_V3, m, "te", frozenset())
    per_rank = 4096 / 8  # the norm / latent region's tokens, and tokens x heads per rank / heads
    assert terms["input_norm"] == per_rank * (2 * 2 * 7168 + 4)  # TENorm: input, output (bf16), rsigma (fp32)
    # The q latent (1536) and kv latent (512), each normed (input, output, rsigma), and the rope key (64) of all
    # 4096 tokens, gathered.
    assert terms["mla_latents"] == per_rank * ((2 * 2 * 1536 + 4) + (2 * 2 * 512 + 4)) + 4096 * 2 * 64
    # Flash attention keeps q and k of 128 heads x (nope 128 + rope 64) and v of 128 heads x 128, then its output
    # and the fp32 log-sum-exp per head.
    assert terms["qkv"] == per_rank * 2 * 128 * (192 + 192 + 128)
    assert terms["context"] == per_rank * 128 * (2 * 128 + 4)
    assert set(terms) == {"input_norm", "mla_latents", "qkv", "context"}  # no [s, s] tensor, no rope tables
    assert mla_activations(DEEPSEEK_V3, m, "te", frozenset({"core_attn"}))["context"] == per_rank * 128 * 2 * 128
    # Its backward holds q, k, v's gradients twice (bf16), nothing [s, s].
    assert attention_transients(DEEPSEEK_V3, m, "te") == (0.0, 2 * per_rank * 2 * 128 * 512)


def test_shared_experts_and_dense_first_layers():
    # DeepSeek-V3 at TP 8 (sequence parallel), EP 64, 4096-token micro batches, nothing recomputed: 3 dense layers of
    # 18432 and 58 MoE layers with a 2048-wide shared expert, each a GLU keeping 5 x its width per token per TP rank.
    tokens = 4096 / 8
    keep = estimate(512, "parallel.tensor=8", "parallel.expert=64", "parallel.expert_tensor=1",
                    "recompute.granularity=none", spec=DEEPSEEK_V3)
    terms = keep.worst.activation_terms
    assert terms["mlp.mlp"] == 3 * tokens * 2 * 5 * 18432
    assert terms["mlp.shared_experts"] == 58 * tokens * 2 * 5 * 2048
    assert terms["mlp.routed_tokens"] == 58 * 8 * tokens * 2 * 7168  # top-8 of each rank's 512 tokens, dispatched
    # recompute.modules=[moe] drops the shared experts with the routed ones (one MoE layer), not the dense MLPs.
    moe = estimate(512, "parallel.tensor=8", "parallel.expert=64", "recompute.granularity=selective",
                   "recompute.modules=[moe]", spec=DEEPSEEK_V3).worst.activation_terms
    assert "mlp.shared_experts" not in moe and moe["mlp.mlp"] == terms["mlp.mlp"]
    # PP 4 puts GLM-4.5's 3 dense layers (of its 92) on the first stage only.
    first, last = estimate(256, "parallel.tensor=8", "parallel.pipeline=4", "parallel.expert=32",
                           "parallel.expert_tensor=1", "recompute.granularity=none", spec=GLM_4_5).stages
    assert first.activation_terms["mlp.mlp"] == 3 * tokens * 2 * 5 * 12288 and "mlp.mlp" not in last.activation_terms


def test_uneven_pipeline_stages():
    """DeepSeek-V3's 61 layers over PP 4 as 13 + 16 + 16 + 16: each stage counts its own layers (the 3 dense ones on
    the first), the stages' parameters add up to the whole model's, and the middle stage is evaluated too."""
    from gspo_megatron.plan.memory import parameter_counts, stage_layers

    layout = ["parallel.tensor=8", "parallel.expert=32", "parallel.expert_tensor=1", "recompute.granularity=full"]
    uneven = load_config(None, BF16 + layout + ["parallel.pipeline=4", "parallel.first_stage_layers=13"])
    assert [len(stage_layers(DEEPSEEK_V3, uneven, i)) for i in range(4)] == [13, 16, 16, 16]
    whole = load_config(None, BF16 + layout + ["parallel.pipeline=1"])
    # (dense parameters per TP rank, expert parameters per EP rank): the same sums, the stages disjoint
    by_stage = [parameter_counts(DEEPSEEK_V3, uneven, i) for i in range(4)]
    dense, experts = parameter_counts(DEEPSEEK_V3, whole, 0)
    assert sum(e for _, e in by_stage) == pytest.approx(experts, rel=1e-12)
    assert sum(d for d, _ in by_stage) == pytest.approx(dense, rel=1e-12)
    stages = estimate(1024, *layout, "recompute.granularity=none", "parallel.pipeline=4",
                      "parallel.first_stage_layers=13", spec=DEEPSEEK_V3).stages
    assert [st.stage for st in stages] == ["first", "middle", "last"]
    assert stages[1].micro_batches_in_flight == 3 and "mlp.mlp" not in stages[1].activation_terms
    assert stages[0].activation_terms["mlp.mlp"] > 0  # the dense layers, on the first stage


def test_kv_cache_per_token():
    from gspo_megatron.plan.servers import kv_cache_bytes_per_token

    # MLA caches the kv latent (512) and the rope key (64) per layer, on every attention-TP rank: 68.6 KiB per token,
    # where 128 heads of K and V (192 + 128 wide) would be 61 x 128 x 320 x 2 B = 4.8 MiB.
    for attention_tp in (1, 8, 16):
        assert kv_cache_bytes_per_token(DEEPSEEK_V3, attention_tp) == 61 * (512 + 64) * 2
    assert kv_cache_bytes_per_token(DEEPSEEK_V3, kv_bytes=1) == 61 * 576  # --kv-cache-dtype fp8_e4m3
    # GQA (GLM-4.5: 8 KV heads of 128): split over attention-TP, one per GPU from 8 on (replicated beyond).
    assert kv_cache_bytes_per_token(GLM_4_5, 1) == 92 * 2 * 8 * 128 * 2
    assert kv_cache_bytes_per_token(GLM_4_5, 8) == kv_cache_bytes_per_token(GLM_4_5, 16) == 92 * 2 * 1 * 128 * 2


def test_server_weights_and_kv_tokens():
    from gspo_megatron.plan.memory import model_parameters
    from gspo_megatron.plan.servers import ServerLayout, server_memory, server_weights_per_gpu

    # On one GPU in bf16 a server holds exactly the model's parameters (MTP layers aside).
    for spec in (DEEPSEEK_V3, GLM_4_5):
        assert server_weights_per_gpu(spec, ServerLayout(tp=1)) == pytest.approx(2 * model_parameters(spec)[0])
    # DP attention replicates the attention over its groups: more weights per GPU, attn_dp times the KV tokens.
    tp = server_memory(DEEPSEEK_V3, ServerLayout(tp=32, ep=32), 79.1)
    dp = server_memory(DEEPSEEK_V3, ServerLayout(tp=32, attn_dp=4, ep=32), 79.1)
    assert dp.weights_per_gpu > tp.weights_per_gpu and dp.fits
    assert dp.tokens_per_server == pytest.approx(4 * dp.kv_per_gpu / (61 * 576 * 2))
    # 671B in bf16 does not load on 16 GPUs of 80 GB.
    assert not server_memory(DEEPSEEK_V3, ServerLayout(tp=16, attn_dp=16, ep=16), 79.1).fits


def test_weight_sync_estimate_by_hand():
    from gspo_megatron.plan.servers import model_sync_estimate, weight_sync_estimate

    e = weight_sync_estimate(671e9, 45_000, bucket_bytes=256 << 20, bytes_per_parameter=2, link_gb_s=45)
    assert e.gigabytes == pytest.approx(1342) and e.wire_s == pytest.approx(1342 / 45)
    assert e.buckets == 5000 and e.calls_s == pytest.approx(15.0)  # ceil(1342e9 / 2^28) calls of 3 ms
    assert e.seconds == pytest.approx((1342 / 45 + 15 + 0.9, 1342 / 45 + 15 + 2.25))
    # The model's own count: every HF tensor the sync sends (DeepSeek-V3: 58 x 256 x 3 expert tensors among them).
    dsv3 = model_sync_estimate(DEEPSEEK_V3)
    assert 58 * 256 * 3 < dsv3.load_s[0] / 20e-6 < 50_000 and dsv3.gigabytes == pytest.approx(1342, rel=1e-3)


def test_fp8_rollouts_halve_the_servers_weights_and_the_sync():
    """``rollout.fp8``: DeepSeek-V3's servers hold and receive 1 B per quantized parameter plus its fp32 scales (4 B
    per 128 x 128 block); the embeddings and lm_head (2 x 129280 x 7168), norms and routers stay bf16. Keeping the
    first and last 3 layers adds their bytes back."""
    from gspo_megatron.model.fp8 import Fp8Scheme
    from gspo_megatron.plan.memory import model_parameters
    from gspo_megatron.plan.servers import (ServerLayout, fp8_bytes_per_parameter, model_sync_estimate,
                                            server_weights_per_gpu)

    parameters = model_parameters(DEEPSEEK_V3)[0]
    vocab = 2 * 129280 * 7168
    per_parameter = fp8_bytes_per_parameter(DEEPSEEK_V3, Fp8Scheme(61))
    # everything else quantized, less than 0.1% of it (norms, routers) left bf16
    by_hand = (vocab * 2 + (parameters - vocab) * (1 + 4 / 128**2)) / parameters
    assert per_parameter == pytest.approx(by_hand, rel=1e-3) and per_parameter < 0.502 * 2
    assert fp8_bytes_per_parameter(DEEPSEEK_V3, Fp8Scheme(61, keep_layers=3)) > per_parameter + 0.05
    sync = model_sync_estimate(DEEPSEEK_V3, bytes_per_parameter=per_parameter)
    assert sync.gigabytes == pytest.approx(673, abs=1) and sync.buckets == 2508
    weights = [server_weights_per_gpu(DEEPSEEK_V3, ServerLayout(tp=1, weight_bytes=w)) for w in (2.0, 1.0)]
    assert weights[1] / 1e9 == pytest.approx(673, abs=1) and weights[0] / 1e9 == pytest.approx(1342, abs=1)


# ---- the gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next) ------------------------------------------------------------

QWEN3_5_397B = read_hf_config(ROOT / "examples/qwen3_5_397b_a17b/hf_config/config.json")


@pytest.mark.parametrize("variant", ["qwen3_5_moe", "qwen3_5", "qwen3_next"])
def test_hybrid_parameter_count_equals_transformers(variant):
    """Every parameter of the tiny hybrids' text models as transformers builds them (the vision tower aside): the
    DeltaNet's in_proj, conv, A_log, dt_bias, gated norm and out_proj, the gated attention's doubled q_proj, the shared
    expert's gate, the zero-centred norms."""
    from gspo_megatron.plan.memory import model_parameters
    from tests.model import hf_tiny

    model = hf_tiny.build_hf_model(variant)
    text = sum(p.numel() for name, p in model.named_parameters() if ".visual." not in name)
    assert model_parameters(read_hf_config(model.config.to_dict()))[0] == text


def test_deltanet_activations_and_recurrent_state_by_hand():
    """Qwen3.5-397B's DeltaNet block (16 key heads of 128, 64 value heads of 128) at TP 2 with sequence parallelism,
    one 9216-token row, bf16: what fla keeps per token and rank, and the recurrent states per 64-token chunk."""
    from gspo_megatron.plan.memory import Micro, deltanet_activations, deltanet_transients

    m = Micro(s=9216, b=1, tp=2, sp=2, cp=1, etp=1, a=2)
    n = 9216 / 2  # tokens x (this rank's heads) / heads
    qk, v, heads = 16 * 128, 64 * 128, 64
    terms = deltanet_activations(QWEN3_5_397B, m, "te", frozenset())
    assert terms["in_proj"] == n * 2 * (2 * qk + 2 * v + 2 * heads)  # [q; k; v; z; b; a]
    assert terms["conv"] == n * 2 * (2 * qk + v) and terms["chunk_A"] == n * heads * 64 * 2
    assert terms["gated_norm"] == n * (2 * v + 4 * heads) and terms["core_out"] == n * 2 * v
    states = 9216 / 64 * 32 * 128 * 128 * 2  # [chunks, heads / t, dk, dv] in bf16: 72 MiB
    forward, backward = deltanet_transients(QWEN3_5_397B, m)
    assert forward == states + n * 2 * heads * 256 and backward > 2 * states
    # A hybrid's stage sums its DeltaNet and attention layers' tensors by kind: 15 layers on PP 4's first stage, every
    # 4th full attention (layers 3, 7, 11; the other 12 DeltaNet).
    first = estimate(256, "parallel.tensor=2", "parallel.pipeline=4", "parallel.expert=32", "parallel.expert_tensor=1",
                     "recompute.granularity=selective", "recompute.modules=[moe]", "rollout.max_prompt_tokens=1024",
                     "rollout.max_new_tokens=8192", spec=QWEN3_5_397B).stages[0]
    assert first.activation_terms["in_proj"] == 12 * terms["in_proj"]
    assert first.activation_terms["output_gate"] == 3 * 2 * n * 2 * 32 * 256  # q's gate and the gated context


def test_hybrid_servers_cache_keys_in_attention_layers_and_a_state_per_sequence():
    from gspo_megatron.plan.servers import deltanet_state_bytes_per_sequence, kv_cache_bytes_per_token

    # 15 of the 60 layers cache K and V (2 heads of 256); the 45 DeltaNet layers hold a state per sequence instead:
    # 64 heads x 128 x 128 fp32 and the conv's last 3 inputs over q, k, v (2 x 2048 + 8192 wide) in bf16.
    assert kv_cache_bytes_per_token(QWEN3_5_397B) == 15 * 2 * 2 * 256 * 2
    state = 45 * (64 * 128 * 128 * 4 + (2 * 2048 + 8192) * 3 * 2)
    assert deltanet_state_bytes_per_sequence(QWEN3_5_397B) == state and state / 2**20 == pytest.approx(183.2, abs=0.1)
    assert deltanet_state_bytes_per_sequence(DEEPSEEK_V3) == 0


# ---- the optimizer in host memory (optimizer.offload_fraction) and bf16 gradients -------------------------------

TINY_MOE = read_hf_config(dict(
    model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    vocab_size=256, tie_word_embeddings=False,
))
GPT_OSS_120B = read_hf_config(ROOT / "examples/gpt_oss_120b/hf_config/config.json")


def test_offloaded_optimizer_moves_its_share_to_host_memory():
    """A tiny Qwen3-MoE at TP 2 x EP 2 on 4 ranks (DP 2, expert-DP 2), bf16, counted by hand from its shapes: the
    offloaded share of the optimizer's shard leaves the GPU and takes 16 B per element in host memory (fp32 master,
    two moments, the gradient's fp32 copy); bf16 gradient buffers halve the gradients and add the fp32 copy the
    optimizer steps on (4 B per element kept on the GPU)."""
    h, layers = 64, 2
    attention = h * 64 + 2 * h * 32 + 64 * h  # q, k, v, o, split over TP
    dense = (layers * attention + 2 * 256 * h) / 2 + layers * (2 * h + 2 * 16 + 4 * h) + h  # + norms, q/k norms, router
    experts = layers * 4 * 3 * h * 32 / 2  # 4 experts over EP 2
    shard = (dense + experts) / 2  # the distributed optimizer: dense over DP 2, experts over expert-DP 2
    layout = ["parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=1"]
    plain = estimate(4, *layout, spec=TINY_MOE).worst
    assert plain.params == (dense + experts) * 2 and plain.grads == (dense + experts) * 4
    assert plain.optimizer == pytest.approx(12 * shard) and plain.host_optimizer == 0
    half = estimate(4, *layout, "optimizer.offload_fraction=0.5", "optimizer.grad_reduce_in_fp32=false",
                    spec=TINY_MOE)
    st = half.worst
    assert st.grads == st.params == (dense + experts) * 2
    assert st.optimizer == pytest.approx(0.5 * 16 * shard) and st.host_optimizer == pytest.approx(0.5 * 16 * shard)
    assert half.host_bytes_per_node(4) == pytest.approx(4 * (0.5 * 16 * shard + 8 * GIB))
    whole = estimate(4, *layout, "optimizer.offload_fraction=1", spec=TINY_MOE).worst
    assert whole.optimizer == 0 and whole.host_optimizer == pytest.approx(16 * shard) and whole.grads == plain.grads
    assert estimate(4, *layout, spec=TINY_MOE).host_bytes_per_node(4) == 0  # nothing offloaded: no host line


def test_gpt_oss_120b_fits_one_h100_node_with_the_optimizer_on_the_host():
    """gpt-oss-120b at TP 4 x EP 8 on one node of 8 (DP 2, expert-DP 1), counted by hand from its config: 116.83B
    parameters; a GPU keeps its bf16 weights and bf16 gradients (4 B per local parameter, 55.4 GiB) and the node's
    host memory the whole optimizer (16 B per parameter of each rank's shard, 1741 GiB, + 8 ranks x 8 GiB)."""
    from gspo_megatron.plan.memory import model_parameters

    h, layers, vocab = 2880, 36, 201088
    attention = h * 4096 + 2 * h * 512 + 4096 * h + 4096 + 2 * 512 + 64  # q, k, v, o, their biases, a sink per head
    expert = 3 * h * 2880 + 2 * 2880 + h  # gate, up, down and their biases
    replicated = layers * (2 * h + h + 128 * h + 128) + h  # norms, o_proj's bias, router and its bias; final norm
    assert model_parameters(GPT_OSS_120B)[0] == layers * (attention + 128 * expert) + 2 * vocab * h + replicated
    dense = (layers * attention + 2 * vocab * h) / 4 + replicated
    experts = layers * 128 * expert / 8
    shard = dense / 2 + experts
    one_node = ["parallel.tensor=4", "parallel.expert=8", "parallel.expert_tensor=1", "parallel.sequence_parallel=true",
                "recompute.granularity=selective", "recompute.modules=[moe]", "rollout.max_new_tokens=4096"]
    e = estimate(8, *one_node, "optimizer.offload_fraction=1", "optimizer.grad_reduce_in_fp32=false",
                 spec=GPT_OSS_120B)
    st = e.worst
    assert st.params == st.grads == (dense + experts) * 2 and st.optimizer == 0
    assert (st.params + st.grads) / GIB == pytest.approx(55.44, abs=0.01)
    assert st.host_optimizer == pytest.approx(16 * shard)
    assert 16 * shard * 8 / GIB == pytest.approx(1741.5, abs=0.1)
    assert e.host_bytes_per_node(8) == pytest.approx(8 * (16 * shard + 8 * GIB))
    assert e.host_bytes_per_node(8) < 2048 * GIB
    assert e.total_bytes < 79.1 * GIB
    # Without the offload the same layout needs the 12 B of Adam state per shard element on the GPU as well.
    plain = estimate(8, *one_node, spec=GPT_OSS_120B).worst
    assert plain.optimizer == pytest.approx(12 * shard) and plain.grads == 2 * plain.params
