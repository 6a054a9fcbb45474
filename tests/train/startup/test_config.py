"""Typed config loading, overrides, validation errors that name the field, and the plan's numbers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gspo_megatron.train.startup.config import ConfigError, load_config
from gspo_megatron.model.hf_config import read_hf_config
from gspo_megatron.plan.memory import estimate_memory, model_parameters
from gspo_megatron.plan.layouts import rank_groups
from gspo_megatron.train.startup.validate import validate

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    vocab_size=151936, tie_word_embeddings=False,
)


def cfg(*overrides):
    return load_config(None, ["data.task=count", *overrides])


def test_defaults_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  group_size: 4\nalgo:\n  name: grpo\n")
    c = load_config(path, ["rollout.group_size=16", "parallel.sequence_parallel=false", "rollout.urls=a,b",
                           "rollout.stop_token_ids=7,9"])
    assert c.rollout.group_size == 16 and c.algo.name == "grpo" and c.rollout.stop_token_ids == [7, 9]
    assert c.parallel.sequence_parallel is False and c.rollout.urls == ["a", "b"]
    assert c.algo.minibatches == 4 and c.rollout.prompts_per_step == 8  # defaults kept


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.group_size=two"], r"rollout.group_size: expected int, got 'two'"),
        (["rollout.gruop_size=4"], r"rollout: unknown field\(s\) \['gruop_size'\]"),
        (["parallel.tensor=1.5"], r"parallel.tensor: expected an integer"),
        (["nonsense"], r"must look like section.field=value"),
        (["rollout.stop_token_ids=[3,x]"], r"rollout.stop_token_ids\[1\]: expected int, got 'x'"),
    ],
)
def test_bad_fields_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize(
    "overrides, world, hf, message",
    [
        (["algo.name=ppo"], 1, None, r"algo.name='ppo' is not one of"),
        (["rollout.stop_token_ids=[5,151936]"], 1, QWEN3_30B_A3B,
         r"rollout.stop_token_ids\[1\]=151936 is not a token id of the vocabulary \(0..151935\)"),
        (["parallel.tensor=4"], 2, None, r"world size=2 is not divisible by parallel.tensor\*pipeline\*context=4"),
        (["parallel.tensor=4"], 4, dict(QWEN3_30B_A3B, num_attention_heads=6), r"num_attention_heads=6 is not divisible by parallel.tensor=4"),
        (["parallel.expert=3", "parallel.expert_tensor=1"], 3, QWEN3_30B_A3B, r"num_experts=128 is not divisible by parallel.expert=3"),
        # DeepSeek-V3 / Kimi-K2 / GLM-4.5 name their routed experts n_routed_experts (once refused as "no experts")
        (["parallel.expert=3", "parallel.expert_tensor=1"], 3,
         dict(model_type="glm4_moe", num_attention_heads=96, num_key_value_heads=8, n_routed_experts=160),
         r"n_routed_experts=160 is not divisible by parallel.expert=3"),
        (["rollout.group_size=1"], 1, None, r"rollout.group_size=1: group advantages need at least 2"),
        (["algo.minibatches=3"], 1, None, r"rollout.prompts_per_step\*group_size=64 is not divisible by algo.minibatches=3"),
        (["algo.routing_replay=true"], 1, None, r"algo.routing_replay=old is the GRPO baseline's fix"),
        (["algo.kl_coef=-0.1"], 1, None, r"algo.kl_coef=-0.1 must be finite and >= 0"),
        (["algo.kl_coef=0.01", "parallel.context=2"], 2, None, r"algo.kl_coef=0.01 with parallel.context=2"),
        (["algo.entropy_coef=-1"], 1, None, r"algo.entropy_coef=-1.0 must be finite and >= 0"),
        (["train.cpu_threads=0"], 1, None, r"train.cpu_threads=0 must be > 0"),
        (["parallel.context=2"], 2, None, r"parallel.context=2 needs TransformerEngine"),
        (["parallel.max_tokens_per_micro_batch=4096"], 1, None,
         r"parallel.max_tokens_per_micro_batch needs parallel.pack_sequences=true"),
        (["model.grouped_gemm=true"], 1, QWEN3_30B_A3B, r"model.grouped_gemm=true needs TransformerEngine"),
        (["parallel.tensor=2", "parallel.sequence_parallel=false"], 2, QWEN3_30B_A3B, r"parallel.sequence_parallel=false"),
        (["recompute.granularity=partial"], 1, None, r"recompute.granularity='partial' is not one of"),
        (["recompute.granularity=selective", "recompute.modules=[]"], 1, None, r"recompute.modules is empty with recompute.granularity=selective"),
        (["recompute.granularity=selective", "recompute.modules=[attention]"], 1, None, r"recompute.modules: 'attention' is not one of"),
        (["recompute.granularity=selective", "recompute.modules=[moe_act]"], 1, None, r"recompute.modules: 'moe_act' needs grouped-GEMM experts .*model.grouped_gemm=null and TransformerEngine does not import"),
        (["recompute.granularity=full", "recompute.method=chunks"], 1, None, r"recompute.method='chunks' is not one of"),
        (["recompute.granularity=full", "recompute.num_layers=25", "parallel.pipeline=2"], 2, QWEN3_30B_A3B,
         r"recompute.num_layers=25 must be in 1..24 \(layers per pipeline stage\)"),
        (["recompute.granularity=full", "recompute.num_layers=9", "parallel.pipeline=2",
          "parallel.first_stage_layers=8"], 2, QWEN3_30B_A3B, r"recompute.num_layers=9 must be in 1..8 \(layers per"),
        (["parallel.pipeline=2"], 2, dict(QWEN3_30B_A3B, num_hidden_layers=47),
         r"num_hidden_layers=47 is not divisible by parallel.pipeline=2: .*uneven stages \(parallel.first_stage_layers"),
        (["parallel.pipeline=4", "parallel.last_stage_layers=10"], 4, dict(QWEN3_30B_A3B, num_hidden_layers=47),
         r"leaves 37 layers for the other 3 stage\(s\)"),
        (["algo.name=grpo", "algo.routing_replay=true", "recompute.granularity=selective", "recompute.modules=[moe]"], 1, None,
         r"algo.routing_replay=old with recompute.granularity='selective' and recompute.modules containing 'moe'"),
        (["algo.routing_replay=sometimes"], 1, None, r"algo.routing_replay='sometimes' is not one of false, old"),
        (["algo.routing_replay=rollout", "rollout.server_args={return_routed_experts: false}"], 1, None,
         r"remove rollout.server_args.return_routed_experts=false"),
        (["algo.routing_replay=rollout"], 1, dict(QWEN3_30B_A3B, num_experts=0), r"algo.routing_replay=rollout replays MoE "
         r"routing but the model has no experts"),
        (["algo.name=grpo", "algo.routing_replay=rollout", "recompute.granularity=full"], 1, None,
         r"algo.routing_replay=rollout with recompute.granularity='full'"),
        (["algo.token_advantages=tokens"], 1, None, r"algo.token_advantages='tokens' is not one of"),
        (["algo.token_advantages=segments"], 1, None, r"algo.token_advantages='segments' needs a loss with per-token"),
        (["algo.name=gspo_token", "algo.token_advantages=segments"], 1, None, r"needs data.segment_reward"),
        # rollout.mode (train/sampling/source.py)
        (["rollout.mode=often"], 1, None, r"rollout.mode='often'"),
        (["rollout.mode=async", "rollout.max_staleness=0"], 1, None, r"rollout.max_staleness=0"),
        (["rollout.mode=async", "rollout.engine=local"], 1, None, r"rollout.engine='local'"),
        (["rollout.mode=one_step_off", "algo.name=grpo", "algo.routing_replay=true"], 1, None, r"algo.routing_replay=old"),
        (["rollout.mode=async", "rollout.filter_zero_variance_groups=true"], 1, None,
         r"rollout.filter_zero_variance_groups"),
        (["algo.decoupled_clip=true", "rollout.reuse_rollout_logprobs=true"], 1, None,
         r"algo.decoupled_clip=true clips around the trainer's old-policy pass"),
        # the rollout correction (algo/correction.py)
        (["correction.high=0"], 1, None, r"correction.low=0.5 and correction.high=0"),
        (["correction.level=tokens"], 1, None, r"correction.level='tokens' is not one of"),
        (["correction.rejection=mean"], 1, None, r"correction.rejection='mean' needs correction.rejection_low"),
        (["correction.veto=2"], 1, None, r"correction.veto=2.0 must lie in \(0, 1\)"),
        # partial rollouts (train/sampling/partial_rollouts.py)
        (["rollout.partial_chunk_tokens=0"], 1, None, r"rollout.partial_chunk_tokens=0"),
        (["rollout.partial_chunk_tokens=2", "rollout.partial_mask=old"], 1, None, r"rollout.partial_mask='old'"),
        (["rollout.partial_mask=old_tokens"], 1, None, r"needs rollout.partial_chunk_tokens"),
        (["rollout.partial_chunk_tokens=2", "rollout.mode=one_step_off"], 1, None, r"rollout.mode=one_step_off"),
        (["rollout.partial_chunk_tokens=2", "rollout.filter_zero_variance_groups=true"], 1, None,
         r"rollout.filter_zero_variance_groups"),
        (["rollout.partial_chunk_tokens=2", "algo.routing_replay=rollout"], 1, None, r"algo.routing_replay=rollout"),
        (["rollout.partial_chunk_tokens=2", "rollout.partial_groups_in_flight=1"], 1, None,
         r"rollout.partial_groups_in_flight=1"),
        # FP8 rollouts (model/fp8.py, rollout/weight_sync.py)
        (["rollout.fp8_keep_layers=2"], 1, None, r"rollout.fp8_keep_layers=2 needs rollout.fp8=true"),
        (["rollout.fp8=true", "rollout.fp8_keep_layers=-1"], 1, None, r"rollout.fp8_keep_layers=-1 must be >= 0"),
        (["rollout.fp8=true", "rollout.engine=local"], 1, None, r"rollout.fp8=true needs rollout.engine=sglang"),
        (["rollout.fp8=true", "rollout.server_args={dtype: float32}"], 1, None,
         r"rollout.server_args.dtype=float32: SGLang's FP8 layers compute in bfloat16 or float16"),
        # the optimizer in host memory and bf16 gradients (train/startup/policy.py's offload_fields)
        (["optimizer.offload_fraction=1.5"], 1, None, r"optimizer.offload_fraction=1.5 must be in \[0, 1\]"),
        (["model.dtype=float32", "optimizer.grad_reduce_in_fp32=false"], 1, None,
         r"optimizer.grad_reduce_in_fp32=false with model.dtype=float32: the gradient buffer takes the parameters'"),
        (["optimizer.offload_fraction=1", "parallel.distributed_optimizer=false"], 1, None,
         r"optimizer.offload_fraction=1 needs parallel.distributed_optimizer=true"),
        (["optimizer.offload_fraction=0.5", "model.dtype=float32"], 1, None,
         r"optimizer.offload_fraction=0.5 with model.dtype=float32: megatron's HybridDeviceOptimizer would not "
         r"update the fp32 parameters kept on the GPU"),
        (["optimizer.offload_fraction=1", "rollout.colocate=true", "rollout.colocate_offload=optimizer"], 1, None,
         r"optimizer.offload_fraction=1 with rollout.colocate_offload=optimizer: the optimizer state is offloaded"),
    ],
)
def test_incompatibilities_name_the_field(overrides, world, hf, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg(*overrides), world, hf)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_the_offloaded_optimizer_is_refused_without_cuda_before_anything_is_built(capsys, monkeypatch):
    """``train`` with optimizer.offload_fraction > 0 on a CPU-only machine stops at the config check, naming the
    field (megatron's HybridDeviceOptimizer runs on CUDA streams); ``plan`` of the same config runs anywhere."""
    from gspo_megatron.cli import main

    monkeypatch.setenv("WORLD_SIZE", "8")
    example = str(Path(__file__).resolve().parents[3] / "examples/gpt_oss_120b/train_one_node.yaml")
    assert main(["train", example]) == 2
    assert "optimizer.offload_fraction=1 needs CUDA (megatron's HybridDeviceOptimizer" in capsys.readouterr().err


@pytest.mark.parametrize("overrides", [
    ["rollout.mode=one_step_off", "rollout.engine=local"],
    ["rollout.mode=async", "rollout.max_staleness=3", "algo.routing_replay=rollout"],
    ["rollout.partial_chunk_tokens=2", "rollout.partial_mask=old_tokens"],
    ["rollout.mode=async", "algo.decoupled_clip=true", "correction.high=5"],
    ["rollout.reuse_rollout_logprobs=true", "correction.rejection=mean", "correction.rejection_high=1e-3"],
    ["rollout.partial_chunk_tokens=2", "algo.decoupled_clip=true", "algo.name=grpo"],
    ["rollout.fp8=true", "rollout.fp8_keep_layers=1", "rollout.server_args={dtype: bfloat16}"],
])
def test_rollout_modes_that_combine(overrides):
    validate(cfg(*overrides), 1)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TransformerEngine is installed")
def test_layernorm_recompute_needs_transformer_engine():
    with pytest.raises(ConfigError, match=r"recompute.modules: 'layernorm' needs TransformerEngine"):
        validate(cfg("recompute.granularity=selective", "recompute.modules=[layernorm]"), 1)


def test_routing_replay_values():
    old = cfg("algo.routing_replay=old").algo
    assert old.routing_replay == "old" and old.replays_old_routing
    assert cfg("algo.routing_replay=true").algo.routing_replay == "old"  # YAML true: an alias of old
    assert cfg("algo.routing_replay=true").algo.replays_old_routing
    r3 = cfg("algo.routing_replay=rollout").algo
    assert r3.routing_replay == "rollout" and r3.replays_rollout_routing and not r3.replays_old_routing
    assert not cfg().algo.routing_replay
    assert cfg().algo.routing_replay is None and cfg("algo.routing_replay=false").algo.routing_replay is None
    validate(cfg("algo.routing_replay=rollout"), 1, QWEN3_30B_A3B)  # with GSPO too: R3 is about the engine's routing


def test_no_data_is_named():
    with pytest.raises(ConfigError, match="data.prompts"):
        validate(load_config(None), 1)


def test_qwen3_30b_a3b_parameter_count():
    total, active = model_parameters(read_hf_config(QWEN3_30B_A3B))
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active (its model card).
    assert 30.3e9 < total < 30.7e9
    assert 3.2e9 < active < 3.5e9


def test_mlp_only_layers_and_sparse_step():
    assert sum(read_hf_config(dict(QWEN3_30B_A3B, mlp_only_layers=[0, 1])).moe_layers) == 46
    assert sum(read_hf_config(dict(QWEN3_30B_A3B, decoder_sparse_step=2)).moe_layers) == 24


def test_rank_groups_match_megatron_order():
    groups = rank_groups(8, cfg("parallel.tensor=2", "parallel.pipeline=2", "parallel.expert=2", "parallel.expert_tensor=1"))
    assert groups["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["pipeline"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["data"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["expert"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_memory_scales_with_the_layout():
    spec = read_hf_config(QWEN3_30B_A3B)
    one = estimate_memory(spec, cfg("parallel.expert=8", "parallel.expert_tensor=1", "model.dtype=bfloat16"), 8, 4096)
    more = estimate_memory(spec, cfg("parallel.expert=16", "parallel.expert_tensor=1", "model.dtype=bfloat16"), 16, 4096)
    # By hand, bf16, TP=1 PP=1: experts 48 * 128 * 3 * 2048 * 768 / EP params, dense (attention, norms,
    # routers, untied embeddings) ~1.51e9 params, 2 bytes each.
    experts = 48 * 128 * 3 * 2048 * 768
    assert one.worst.params == pytest.approx((experts / 8 + 1.51e9) * 2, rel=0.01)
    assert more.worst.params == pytest.approx((experts / 16 + 1.51e9) * 2, rel=0.01)


@pytest.mark.parametrize("text, overrides, message", [
    ("model:\n  hf_dir: [a\nrollout:\n  group_size: 4\n", [],
     "{yaml}:3:8: not valid YAML: while parsing a flow sequence; expected ',' or ']', but got ':'"),
    ("- a\n- b\n", [], "{yaml}: the top level must be a mapping of sections"),
    ("optimiser:\n  lr: 1.0\n", [], "unknown section(s) ['optimiser'] (did you mean 'optimizer'?); known: ['algo'"),
    ("", ["rollout.gruop_size=3"], "rollout: unknown field(s) ['gruop_size'] (did you mean 'group_size'?)"),
    ("", ["rollout.gruop_size=3", "rollout.tmperature=1"],
     "(did you mean 'group_size' for 'gruop_size', 'temperature' for 'tmperature'?)"),
])
def test_config_file_errors_are_sentences_with_did_you_mean(tmp_path, text, overrides, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(path, overrides)
    assert message.format(yaml=path) in str(error.value), str(error.value)


@pytest.mark.parametrize("overrides, message", [
    (["train.steps=0"], "train.steps=0 must be > 0"),
    (["train.steps=-5"], "train.steps=-5 must be > 0"),
    (["model.dtype=bf16"], "model.dtype: unknown dtype ['bf16'] (did you mean 'bfloat16'?); one of: ['bfloat16', "
                           "'float32']"),
    (["rollout.server_args={max_total_token: 10}"],
     "rollout.server_args: unknown key(s) ['max_total_token'] (did you mean 'max_total_tokens'?)"),
    (["rollout.server_args={mem_fraction: 0.5}"], "SGLang's own command-line flags go in rollout.server_args.extra_args"),
    (["rollout.server_args={urls: [a]}"], "rollout.server_args: ['urls'] come from other fields (rollout.urls"),
    (["rollout.server_args={dtype: bf16}"], "rollout.server_args.dtype: unknown dtype ['bf16'] (did you mean "
                                            "'bfloat16'?); one of: ['auto', 'bfloat16', 'float'"),
])
def test_values_refused_before_anything_starts(overrides, message):
    with pytest.raises(ConfigError) as error:
        validate(cfg(*overrides), 1, None)
    assert message in str(error.value), str(error.value)


def test_relative_paths_in_a_yaml_are_relative_to_its_folder(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf/c.yaml"
    path.write_text("model:\n  hf_dir: ../models/m\ndata:\n  prompts: prompts.jsonl\n"
                    f"checkpoint:\n  dir: {tmp_path}/abs/ck\nlogging:\n  dir: ~/runs/x\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    c = load_config(str(path), ["data.eval_prompts=eval.jsonl"])
    assert c.model.hf_dir == str(tmp_path / "models/m") and c.data.prompts == str(tmp_path / "conf/prompts.jsonl")
    assert c.checkpoint.dir == f"{tmp_path}/abs/ck" and c.logging.dir == "~/runs/x"  # absolute and ~ kept
    assert c.data.eval_prompts == "eval.jsonl"  # the command line's: the working directory's
    # the shipped examples mean the same from anywhere: their runs/ at the repository root, their shipped configs
    root = Path(__file__).resolve().parents[3]
    assert load_config(root / "examples/tiny_moe_cpu.yaml").logging.dir == str(root / "runs/tiny_moe_cpu")
    assert load_config(root / "examples/qwen3_30b_a3b/train.yaml").model.hf_dir == str(
        root / "examples/qwen3_30b_a3b/hf_config")


def test_null_unsets_a_field(tmp_path):
    """`field=null` on the command line, or a field left empty in a YAML, is the field's default (an optional
    field's None), never the string "None"."""
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  task: count\n  eval_prompts: evals.jsonl\n  label_key:\nparallel:\n  expert_tensor: 1\n")
    c = load_config(path, ["data.eval_prompts=null", "parallel.expert_tensor=null", "rollout.group_size=null"])
    assert c.data.eval_prompts == "" and c.data.label_key == "" and c.parallel.expert_tensor is None
    assert c.rollout.group_size == cfg().rollout.group_size  # a number that must be set: its default


def test_sglang_flags_in_extra_args_are_checked_against_sglang():
    pytest.importorskip("sglang")
    from gspo_megatron.train.startup.validate import check_sglang_flags

    check_sglang_flags(["--enable-return-routed-experts", "--mem-fraction-static", "0.5"])
    with pytest.raises(ConfigError) as error:
        check_sglang_flags(["--mem-fracton-static", "0.5"])
    assert str(error.value) == ("rollout.server_args.extra_args: not flags of sglang.launch_server "
                                "['--mem-fracton-static'] (did you mean '--mem-fraction-static'?)")


@pytest.mark.megatron  # what it accepts depends on megatron-core's version
def test_mla_down_proj_fusion_is_checked_before_any_rank_starts():
    """megatron's fused MLA down projection: accepted for MLA with q LoRA on a megatron-core that has it (0.19),
    refused by name on 0.16.1, for Moonlight's shape (no q LoRA) and for models without MLA."""
    from gspo_megatron.model.mla import megatron_has_down_proj_fusion
    from tests.model.test_hf_config import DEEPSEEK_V3

    fused = cfg("model.mla_down_proj_fusion=true")
    if not megatron_has_down_proj_fusion():
        with pytest.raises(ConfigError, match=r"model.mla_down_proj_fusion=true needs a megatron-core .* 0.16.1"):
            validate(fused, 1, DEEPSEEK_V3)
        return
    validate(fused, 1, DEEPSEEK_V3)
    with pytest.raises(ConfigError, match=r"has no q LoRA \(q_lora_rank null, as Moonlight\)"):
        validate(fused, 1, dict(DEEPSEEK_V3, q_lora_rank=None))
    with pytest.raises(ConfigError, match=r"qwen3_moe has none: set model.mla_down_proj_fusion=false"):
        validate(fused, 1, QWEN3_30B_A3B)


def test_context_parallelism_with_a_gated_deltanet_model_is_refused_before_any_rank_starts():
    """Qwen3.5 / Qwen3-Next under parallel.context > 1: refused by name while validating (where TransformerEngine is
    installed, the one place CP gets this far), for the vision-language checkpoint by its text model."""
    from gspo_megatron.train.startup.validate import validate_model

    qwen35_moe = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                  "text_config": {"model_type": "qwen3_5_moe_text"}}
    qwen3_next = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}
    for hf, name in ((qwen35_moe, "qwen3_5_moe_text"), (qwen3_next, "qwen3_next")):
        with pytest.raises(ConfigError, match=rf"context=2: {name}'s gated-DeltaNet .* set parallel.context=1"):
            validate_model(cfg("parallel.context=2"), hf)
        validate_model(cfg(), hf)
    validate_model(cfg("parallel.context=2"), {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]})
