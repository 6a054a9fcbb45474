"""Grouped-GEMM experts (megatron's TEGroupedMLP) in the mapping, the bridge and dist checkpoints, on CPU.

TEGroupedMLP is megatron-core's own class; its two GroupedLinears are megatron's TE wrappers compiled over a
stand-in for TransformerEngine's GroupedLinear (``tests.model.te_grouped_linear``: TE's parameter names and shapes,
a matmul loop for the grouped GEMM). What that proves, on two gloo ranks with the tiny Qwen3-MoE (4 experts):

- the expert parameters are exactly ``decoder.layers.{l}.mlp.experts.linear_fc{1,2}.weight{i}`` (i = local
  expert), with no ``local_experts`` left, and the mapping places every one of them;
- HF weights loaded through the bridge give transformers' logits (<= 1e-4, as the other bridge tests), and the
  export is bit for bit the HF files, at world=1 (data parallel), EP=2 and expert-TP=2 (GLU rows [gate_r; up_r]);
- a dist checkpoint saved by the SequentialMLP model loads into the grouped model under every one of those layouts
  (megatron's sharded keys for experts are layout independent), and one saved by the grouped model under EP=2
  loads into SequentialMLP: after either, the export equals the HF files bit for bit.

Not proven here: TE's own GroupedLinear kernels and FP8 extra state (TE needs CUDA; tests/gpu runs the TE model).
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from tests.model import hf_tiny

pytestmark = pytest.mark.megatron  # builds a Megatron model

DP2, EP2, ETP2 = Layout(), Layout(expert=2), Layout(tensor=2, sequence_parallel=True)


def _grouped_model(spec, layout):
    from gspo_megatron.model.process_groups import ensure_model_parallel
    from gspo_megatron.model.provider import build_gpt_model
    from tests.model.te_grouped_linear import local_spec_with_grouped_experts

    ensure_model_parallel(layout)
    with local_spec_with_grouped_experts():
        return build_gpt_model(spec, layout, use_te=False, grouped_gemm=True, init=True)


def _sequential_model(spec, layout):
    from gspo_megatron.model.process_groups import ensure_model_parallel
    from gspo_megatron.model.provider import build_gpt_model

    ensure_model_parallel(layout)
    return build_gpt_model(spec, layout, init=True)


def _export_check(bridge, model, files) -> list[str]:
    """HF names whose exported tensor differs from the file's, bit for bit (every rank iterates the export)."""
    return [name for name, tensor in bridge.export_hf_weights(model) if not hf_tiny.same_bits(tensor, files.read(name))]


def grouped_checks(hf_dir: str, work: str) -> dict:
    from megatron.core import parallel_state as ps

    from gspo_megatron.model import checkpoint
    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.hf_files import SafetensorsDir
    from gspo_megatron.model.provider import decoder_block_spec, experts_modules, transformer_config
    from tests.model.rank_checks import megatron_logits
    from tests.model.te_grouped_linear import local_spec_with_grouped_experts

    spec, files = read_hf_config(hf_dir), SafetensorsDir(hf_dir)
    out = {"hf_tensors": len(files.shapes())}
    bridge = Bridge(spec)
    reference = torch.load(f"{hf_dir}.reference.pt")

    config = transformer_config(spec, DP2, grouped_gemm=True)
    with local_spec_with_grouped_experts():
        out["modules"] = sorted(experts_modules(decoder_block_spec(config, use_te=False)))
    try:  # without TE's grouped linear, megatron's local spec would build the legacy GroupedMLP
        decoder_block_spec(config, use_te=False)
    except ValueError as error:
        out["refused"] = str(error)
    # SequentialMLP at world=1 (data parallel): HF -> Megatron -> dist checkpoint, the source of the loads below.
    sequential = _sequential_model(spec, DP2)
    bridge.load_hf_weights(sequential, hf_dir)
    checkpoint.save_weights(sequential, f"{work}/sequential")

    for name, layout in (("dp2", DP2), ("ep2", EP2), ("etp2", ETP2)):
        model = _grouped_model(spec, layout)
        case = out[name] = {}
        case["expert_params"] = sorted(n for n, _ in model.named_parameters() if ".mlp.experts." in n)
        case["expert_shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters() if ".mlp.experts." in n}
        case["placed"] = sorted(p.megatron_name for p in bridge.placements(model) if ".mlp.experts." in p.megatron_name)
        bridge.load_hf_weights(model, hf_dir)
        logits = megatron_logits(model, reference["tokens"])
        case["logits_diff"] = (logits[..., : spec.vocab_size] - reference["logits"]).abs().max().item()
        case["export_not_bitwise"] = _export_check(bridge, model, files)
        case["exported"] = len(bridge.export_names(model))
        # A fresh (randomly initialised) grouped model, loaded from the SequentialMLP checkpoint.
        model = _grouped_model(spec, layout)
        case["fresh_differs"] = len(_export_check(bridge, model, files))
        checkpoint.load_weights(model, f"{work}/sequential")
        case["from_sequential_not_bitwise"] = _export_check(bridge, model, files)
        if name == "ep2":
            checkpoint.save_weights(model, f"{work}/grouped_ep2")
    # ... and the other way: the grouped EP=2 checkpoint into SequentialMLP at world=1.
    sequential = _sequential_model(spec, DP2)
    out["sequential_fresh_differs"] = len(_export_check(bridge, sequential, files))
    checkpoint.load_weights(sequential, f"{work}/grouped_ep2")
    out["sequential_from_grouped_not_bitwise"] = _export_check(bridge, sequential, files)
    out["ep_rank"], out["etp"] = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grouped")
    hf_dir = hf_tiny.save_variant("qwen3_moe", directory)
    work = directory / "checkpoints"
    for name in ("sequential", "grouped_ep2"):
        (work / name).mkdir(parents=True)
    return run_on_ranks(grouped_checks, 2, DP2, str(hf_dir), str(work))


def _expected_names(local_experts: int) -> list[str]:
    # The tiny qwen3_moe has its MoE layer at 0 (layer 1 is dense).
    return sorted(f"decoder.layers.0.mlp.experts.linear_fc{k}.weight{i}" for k in (1, 2) for i in range(local_experts))


@pytest.mark.parametrize("rank", [0, 1])
def test_grouped_experts_have_te_names_and_map(results, rank):
    result = results[rank]
    assert result["modules"] == ["TEGroupedMLP"]
    for name, local, etp in (("dp2", 4, 1), ("ep2", 2, 1), ("etp2", 4, 2)):
        case = result[name]
        assert case["expert_params"] == _expected_names(local), name
        assert case["placed"] == case["expert_params"], name
        # hidden 32, moe_ffn 16: fc1 [2 * 16 / etp, 32] (gate and up), fc2 [32, 16 / etp], per expert
        assert case["expert_shapes"]["decoder.layers.0.mlp.experts.linear_fc1.weight0"] == (32 // etp, 32), name
        assert case["expert_shapes"]["decoder.layers.0.mlp.experts.linear_fc2.weight0"] == (32, 16 // etp), name


@pytest.mark.parametrize("rank", [0, 1])
def test_grouped_experts_load_hf_weights_and_export_them_bitwise(results, rank):
    for name in ("dp2", "ep2", "etp2"):
        case = results[rank][name]
        assert case["logits_diff"] <= 1e-4, (name, case["logits_diff"])
        assert case["exported"] == results[rank]["hf_tensors"], name  # every HF tensor, once
        assert case["export_not_bitwise"] == [], name


@pytest.mark.parametrize("rank", [0, 1])
def test_sequential_checkpoint_loads_into_grouped_experts_and_back(results, rank):
    result = results[rank]
    for name in ("dp2", "ep2", "etp2"):
        assert result[name]["fresh_differs"] > 0, name  # the load below has something to do
        assert result[name]["from_sequential_not_bitwise"] == [], name
    assert result["sequential_fresh_differs"] > 0
    assert result["sequential_from_grouped_not_bitwise"] == []


def test_grouped_gemm_without_te_grouped_linear_is_refused(results):
    """Without TE megatron's local spec would build the legacy GroupedMLP (0.16: weight1/weight2, grouped_gemm
    package) or a SequentialMLP (0.19), not the grouped experts asked for."""
    assert "grouped_gemm=True needs TransformerEngine >= 1.9" in results[0]["refused"]
    # megatron-core 0.16 builds its legacy GroupedMLP there, 0.19 a SequentialMLP: refused either way.
    assert "would build GroupedMLP" in results[0]["refused"] or "would build SequentialMLP" in results[0]["refused"]
