"""Block-scaled FP8 checkpoints (``model.fp8``): the tiny DeepSeek-V3 model quantized here as DeepSeek-V3's are
(float8_e4m3fn linear weights, one fp32 ``weight_scale_inv`` per block, bf16 for the rest; blocks of 16 x 12 so edge
blocks are partial), then read back: every tensor the bridge sees equals its dequantized reference (written out
block by block below) bit for bit, the scales are hidden, and converting to Megatron and back (world=1) and
``score`` give exactly what the dequantized bf16 checkpoint gives.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from gspo_megatron.model.bridge import Bridge
from gspo_megatron.model.hf_config import read_hf_config
from gspo_megatron.model.hf_files import SafetensorsDir, open_hf_dir
from tests.model import hf_tiny

ROOT = Path(__file__).resolve().parents[2]
BLOCK = (16, 12)
SUM_TOL = 1e-4  # a record's log-prob sum, Megatron vs transformers in fp32 (tests/tools/test_score.py's tolerance)
# DeepSeek-V3 quantizes the linear weights of attention and MLPs, not embeddings, norms, the router or lm_head.
QUANTIZED = ("proj.weight", "proj_with_mqa.weight")


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    scale = torch.empty(math.ceil(rows / BLOCK[0]), math.ceil(cols / BLOCK[1]))
    out = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = weight[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]]
            scale[i, j] = block.abs().max() / 448.0
            out[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]] = block / scale[i, j]
    return out, scale


def _reference(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block by block: each block's fp8 values times its scale, in bf16."""
    out = torch.empty(fp8.shape, dtype=torch.bfloat16)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            out[rows, cols] = (fp8[rows, cols].float() * scale[i, j]).to(torch.bfloat16)
    return out


@pytest.fixture(scope="module")
def fp8_models(hf_models, tmp_path_factory):
    """(FP8 directory, its dequantized bf16 twin, {name: reference}) from the tiny DeepSeek-V3 model."""
    from safetensors.torch import load_file, save_file

    source = hf_models["deepseek_v3"]
    work = tmp_path_factory.mktemp("fp8")
    quantized, dequantized = work / "fp8", work / "dequantized"
    for target in (quantized, dequantized):
        shutil.copytree(source, target)
    tensors, plain, references = {}, {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(QUANTIZED):
            fp8, scale = _quantize(tensor)
            tensors[name], tensors[name + "_scale_inv"] = fp8, scale
            plain[name] = references[name] = _reference(fp8, scale)
        else:  # norms, embeddings, router, lm_head: bf16 (the router bias stays fp32, as transformers keeps it)
            keep = tensor.dtype if name.endswith("e_score_correction_bias") else torch.bfloat16
            tensors[name] = plain[name] = tensor.to(keep)
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, dequantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (dequantized / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, dequantized, references


def test_fp8_weights_read_as_their_dequantized_reference(fp8_models):
    quantized, dequantized, references = fp8_models
    raw, source = SafetensorsDir(quantized), open_hf_dir(quantized)
    assert sum(d == torch.float8_e4m3fn for d in raw.dtypes().values()) == len(references) > 10
    assert not any(n.endswith("_scale_inv") for n in source.shapes())
    plain = SafetensorsDir(dequantized)
    assert source.shapes() == plain.shapes() and source.dtypes() == plain.dtypes()
    Bridge(read_hf_config(quantized)).check_hf_tensors(source.shapes())
    for name in source.shapes():
        assert hf_tiny.same_bits(source.read(name), plain.read(name)), name
    for name, reference in references.items():
        assert hf_tiny.same_bits(source.read(name), reference), name
        rows = (slice(reference.shape[0] // 2, None), slice(None))  # a TP rank's slice of the dequantized weight
        assert hf_tiny.same_bits(source.read(name, rows), reference[rows]), name


def _convert_and_score(quantized: str, dequantized: str, megatron_dir: str, back: str) -> dict:
    from gspo_megatron.model.convert import hf_to_megatron, megatron_to_hf
    from gspo_megatron.parallel.groups import Layout
    from gspo_megatron.score import score_on_this_rank
    from tests.model.rank_checks import score_records_for_tests

    hf_to_megatron(quantized, megatron_dir, Layout())
    megatron_to_hf(megatron_dir, back, None, Layout())
    records = score_records_for_tests(read_hf_config(quantized).vocab_size)
    return {"fp8": score_on_this_rank(quantized, records, Layout(), 2, None),
            "dequantized": score_on_this_rank(dequantized, records, Layout(), 2, None)}


@pytest.mark.megatron
def test_fp8_checkpoint_converts_and_scores_as_its_dequantized_twin(fp8_models, tmp_path):
    from gspo_megatron.parallel.groups import Layout
    from gspo_megatron.parallel.launch import run_on_ranks

    quantized, dequantized, _ = fp8_models
    back = tmp_path / "back"
    (result,) = run_on_ranks(_convert_and_score, 1, Layout(), str(quantized), str(dequantized),
                             str(tmp_path / "megatron"), str(back), timeout=300)
    exported, plain = SafetensorsDir(back), SafetensorsDir(dequantized)
    assert exported.shapes() == plain.shapes()
    for name in plain.shapes():
        assert hf_tiny.same_bits(exported.read(name), plain.read(name)), name
    config = json.loads((back / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert result["fp8"] == result["dequantized"]  # bf16 log-probs of the same weights: identical


# ---- one way to open an HF directory: the commands accept what the load reads ------------------------------------


def test_only_open_hf_dir_opens_an_hf_directory():
    """The load, the converters, ``score`` and the pre-flight checks read a checkpoint through ``open_hf_dir``; a raw
    ``SafetensorsDir`` elsewhere would list an FP8 checkpoint's scales, which the load hides (the refusal of FP8
    checkpoints by ``train``'s and ``score``'s pre-flight was exactly that)."""
    import ast

    package = ROOT / "gspo_megatron"
    raw = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "hf_files.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "SafetensorsDir":
                raw.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not raw, f"SafetensorsDir opened outside hf_files (use hf_files.open_hf_dir): {raw}"


def test_preflight_accepts_an_fp8_checkpoint_and_still_names_a_wrong_tensor(fp8_models, tmp_path):
    """``train``'s pre-flight on the FP8 directory passes (it refused the 120 scales before), and a wrong shape
    in it is still named: the check sees the dequantized tensors, not nothing."""
    from safetensors.torch import load_file, save_file

    from gspo_megatron.train.startup.bootstrap import preflight
    from gspo_megatron.train.startup.config import ConfigError, load_config

    quantized, _, _ = fp8_models
    example = ROOT / "examples/tiny_moe_cpu.yaml"
    cfg = load_config(example, [f"model.hf_dir={quantized}", "data.reward_workers=0"])
    preflight(cfg)
    broken = tmp_path / "broken"
    shutil.copytree(quantized, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 5, dtype=torch.float8_e4m3fn)  # one block
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    cfg = load_config(example, [f"model.hf_dir={broken}", "data.reward_workers=0"])
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight"):
        preflight(cfg)


def _command(*args):
    """A command line as a user runs it (in a process forked from the warm server: ``tests.warm_cli``)."""
    import os
    import sys

    from tests import warm_cli

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = warm_cli.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=600)
    assert out.returncode == 0, f"{args[:3]} failed:\n{out.stderr[-3000:]}"
    return out


def _scored(*args) -> list[float]:
    out = _command("-m", "gspo_megatron.cli", "score", *args)
    return [json.loads(line)["logprob_sum"] for line in out.stdout.splitlines()]


@pytest.mark.megatron  # score and the converters build the Megatron model, as the covering test does in process
@pytest.mark.megatron_covered_by("tests/model/test_fp8.py::test_fp8_checkpoint_converts_and_scores_as_its_dequantized_twin")
def test_score_and_both_converters_take_the_fp8_checkpoint_from_the_command_line(fp8_models, tmp_path):
    """The FP8 DeepSeek-V3 directory (blocks of 16 x 12: partial edge blocks) through the commands: ``score`` equals
    transformers on the dequantized twin (fp32, SUM_TOL), and so do ``score --backend transformers`` on the FP8
    directory (exactly: the same weights, the same code) and ``score`` on its conversion; converted to Megatron and
    back, every tensor equals the dequantized twin's bit for bit and config.json loses its quantization_config."""
    from tests.model import rank_checks

    quantized, dequantized, _ = fp8_models
    records = rank_checks.score_records_for_tests(read_hf_config(quantized).vocab_size)
    records_file = tmp_path / "records.jsonl"
    records_file.write_text("".join(json.dumps({"prompt_ids": list(r.prompt_ids), "response_ids": list(r.response_ids)})
                                    + "\n" for r in records))
    common = ("--input", records_file, "--dtype", "float32")
    reference = _scored("--model", dequantized, "--backend", "transformers", *common)
    assert _scored("--model", quantized, "--backend", "transformers", *common) == reference
    ours = _scored("--model", quantized, *common)
    assert max(abs(a - b) for a, b in zip(ours, reference)) <= SUM_TOL, (ours, reference)

    megatron_dir, back = tmp_path / "megatron", tmp_path / "back"
    _command(ROOT / "tools/convert_hf_to_megatron.py", "--hf-dir", quantized, "--out", megatron_dir)
    _command(ROOT / "tools/convert_megatron_to_hf.py", "--megatron-dir", megatron_dir, "--out", back)
    exported, plain = SafetensorsDir(back), SafetensorsDir(dequantized)
    assert exported.shapes() == plain.shapes()
    for name in plain.shapes():
        assert hf_tiny.same_bits(exported.read(name), plain.read(name)), name
    assert "quantization_config" not in json.loads((back / "config.json").read_text())
    assert _scored("--model", megatron_dir, *common) == ours  # the same weights through the same pass


@pytest.fixture(scope="module")
def fp8_example_model(tmp_path_factory):
    """The CPU example's tiny Qwen3-MoE (random weights, its character tokenizer), released as FP8: (FP8 directory,
    {name: dequantized reference})."""
    from safetensors.torch import load_file, save_file

    from gspo_megatron.rewards.synthetic import save_tiny_model
    from gspo_megatron.train.startup.config import load_config

    tiny = load_config(ROOT / "examples/tiny_moe_cpu.yaml").model.tiny
    model = save_tiny_model(tmp_path_factory.mktemp("example") / "fp8", seed=0, **tiny)
    tensors, references = {}, {}
    for name, tensor in load_file(model / "model.safetensors").items():
        if name.endswith(QUANTIZED):
            fp8, scale = _quantize(tensor)
            tensors[name], tensors[name + "_scale_inv"] = fp8, scale
            references[name] = _reference(fp8, scale)
        else:
            tensors[name] = tensor.to(torch.bfloat16)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    config.update(dtype="bfloat16", quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                         "weight_block_size": list(BLOCK)})
    (model / "config.json").write_text(json.dumps(config))
    return model, references


@pytest.mark.megatron  # trains the Megatron policy through the CLI (what is FP8 here is not megatron-core's)
@pytest.mark.megatron_covered_by("tests/train/test_loop.py::test_train_logs_plots_and_resumes_exactly")
def test_train_on_an_fp8_checkpoint_serves_its_dequantized_weights(fp8_example_model, tmp_path):
    """``gspo-megatron train`` with ``model.hf_dir`` an FP8 checkpoint and SGLang launched by the trainer: the server
    starts from the dequantized copy in logging.dir (no scales, no quantization_config, every weight equal to its
    reference), and the engine's log-probs equal the trainer's at both steps (fp32: the second after a weight
    sync), so the server serves the weights the trainer holds."""
    model, references = fp8_example_model
    run = tmp_path / "run"
    out = _command("-m", "gspo_megatron.cli", "train", ROOT / "examples/tiny_moe_cpu.yaml", f"model.hf_dir={model}",
                   "train.steps=2", "train.eval_every=0", f"logging.dir={run}", f"checkpoint.dir={run / 'ck'}",
                   "logging.plot_every=0", "rollout.prompts_per_step=2", "rollout.group_size=4",
                   "parallel.micro_batch_size=4", "data.reward_workers=0")
    served = run / "engine_model"
    assert f"writing its dequantized copy for the rollout engine to {served}" in out.stdout
    config = json.loads((served / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    copy = SafetensorsDir(served)
    assert not any(n.endswith("_scale_inv") for n in copy.shapes())
    for name, reference in references.items():
        assert hf_tiny.same_bits(copy.read(name), reference), name
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["logprob_diff_max"] <= 1e-4, (s["step"], s["logprob_diff_max"])
