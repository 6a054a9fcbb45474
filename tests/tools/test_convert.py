"""HF -> Megatron -> HF is bit for bit, under resharding layouts and from the command line; bad inputs stop
with an error naming the tensor or field and leave no output directory behind.

The multi-rank conversions run in the session's shared 2-rank launch (``tests/model/rank_checks.py``):
converted under one layout (EP=2, TP=2+SP, PP=2, DP=2) and back under another, with 20 KB shards so the
output has several safetensors files and an index. The command-line tools run once each in a single process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gspo_megatron.model.atomic import atomic_output_dir, replaced_dir
from gspo_megatron.model.checkpoint import HF_DIR, METADATA_FILE
from gspo_megatron.model.convert import hf_to_megatron, megatron_to_hf
from gspo_megatron.model.errors import MappingError, UnsupportedModel
from gspo_megatron.model.hf_config import serving_config
from gspo_megatron.model.hf_files import INDEX_FILE, SafetensorsDir
from tests import warm_cli
from tests.model import hf_tiny, rank_checks

ROOT = Path(__file__).resolve().parents[2]
METADATA_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


def assert_same_hf_checkpoint(original: Path, converted: Path) -> None:
    """Every tensor bit for bit, the same tensor names, and byte-identical config / tokenizer files; a config that
    lacks the fields SGLang reads (``Family.serving_fields``: DeepSeek's moe_layer_freq, ...) comes back with them."""
    before, after = SafetensorsDir(original), SafetensorsDir(converted)
    assert set(after.shapes()) == set(before.shapes())
    different = [n for n in before.shapes() if not hf_tiny.same_bits(after.read(n), before.read(n))]
    assert not different, f"not bit for bit: {different}"
    names = METADATA_FILES
    config = json.loads((original / "config.json").read_text())
    if serving_config(config) != config:
        assert json.loads((converted / "config.json").read_text()) == serving_config(config)
        names = [name for name in METADATA_FILES if name != "config.json"]
    for name in names:
        assert (converted / name).read_bytes() == (original / name).read_bytes(), name


def no_leftovers(out: Path) -> bool:
    """Neither the output nor a temporary sibling of it exists."""
    return not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial")]


@pytest.mark.megatron  # checks the Megatron model's results (a session fixture built it)
@pytest.mark.parametrize("variant", list(rank_checks.CONVERT_LAYOUTS))
def test_round_trip_through_megatron_under_two_layouts_is_bitwise(variant, hf_models, rank_results, rank_work):
    rank_checks.result(rank_results, ("to_megatron", variant))
    rank_checks.result(rank_results, ("to_hf", variant))
    megatron_dir, back = rank_work / "megatron" / variant, rank_work / "hf_back" / variant
    assert (megatron_dir / METADATA_FILE).is_file() and (megatron_dir / "metadata.json").is_file()
    assert (megatron_dir / HF_DIR / "tokenizer.json").is_file()
    original = hf_tiny.bf16_model(hf_models) if variant == hf_tiny.BF16 else hf_models[variant]
    assert_same_hf_checkpoint(original, back)
    index = json.loads((back / INDEX_FILE).read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((back / f).is_file() for f in files)
    assert sorted(p.name for p in back.glob("*.safetensors")) == sorted(files)
    assert no_leftovers(rank_work / "hf_back" / f"{variant}-never")  # and no .partial dirs in hf_back
    assert not [p for p in (rank_work / "hf_back").iterdir() if ".partial" in p.name]


@pytest.mark.megatron  # checks the Megatron model's results (a session fixture built it)
def test_round_tripped_checkpoint_loads_in_transformers(rank_results, rank_work, hf_models):
    from transformers import AutoModelForCausalLM

    back = rank_work / "hf_back" / "qwen3_moe"
    reference = torch.load(hf_models["qwen3_moe"].parent / "qwen3_moe.reference.pt")
    model = AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager")
    with torch.no_grad():
        assert torch.equal(model(reference["tokens"]).logits, reference["logits"])


@pytest.mark.megatron  # checks the Megatron model's results (a session fixture built it)
@pytest.mark.parametrize("case", list(rank_checks.BAD_CHECKPOINTS))
def test_mismatched_megatron_checkpoints_name_the_tensors(case, rank_results, rank_work):
    expected = {
        "shape_mismatch": "decoder.layers.0.mlp.linear_fc1.weight has shape [128, 32], the model needs [192, 32]",
        "missing_tensors": "missing tensors (8): decoder.layers.2.mlp.linear_fc1.layer_norm_weight",
        "unexpected_tensors": "unexpected tensors (7): decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
    }[case]
    for r in rank_checks.result(rank_results, ("bad_checkpoint", case)):
        assert r["error"] == "MappingError", r
        assert expected in r["message"], r["message"]
        assert not r["out_exists"] and not r["leftovers"]


@pytest.mark.megatron  # checks the Megatron model's results (a session fixture built it)
def test_optimizer_state_in_a_checkpoint_is_not_an_unexpected_tensor(hf_models, rank_results, rank_work):
    """Training checkpoints (model + optimizer state) convert as they are; other extra tensors are named."""
    (optimizer, _), (model_like, _) = (rank_checks.result(rank_results, ("extra_tensors", kind))
                                       for kind in ("optimizer", "model_like"))
    assert optimizer["error"] is None, optimizer
    assert_same_hf_checkpoint(hf_models["llama"], rank_work / "hf_back" / "extra_optimizer")
    assert model_like["error"] == "MappingError" and not model_like["out_exists"]
    assert "unexpected tensors (1): decoder.layers.7.self_attention.linear_qkv.weight" in model_like["message"]


# ---- bad HF inputs: checked before any process group starts ------------------------------------------------


def _edited_copy(source: Path, target: Path, edit) -> Path:
    """A copy of an HF directory whose tensors (a dict) ``edit`` changes."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.mlp.down_proj.weight"),
     "missing tensors (1): model.layers.1.mlp.down_proj.weight"),
    (lambda t: t.update({"model.layers.0.mlp.shared_expert_gate.weight": torch.zeros(1, 32)}),
     "unexpected tensors (1): model.layers.0.mlp.shared_expert_gate.weight"),
    (lambda t: t.update({"model.layers.0.mlp.experts.2.gate_proj.weight": torch.zeros(8, 32)}),
     "model.layers.0.mlp.experts.2.gate_proj.weight has shape [8, 32], the config needs [16, 32]"),
])
def test_bad_hf_tensors_stop_with_their_names_and_no_output(edit, message, hf_models, tmp_path):
    bad = _edited_copy(hf_models["qwen3_moe"], tmp_path / "bad_hf", edit)
    out = tmp_path / "out"
    with pytest.raises(MappingError, match=re.escape(message)):
        hf_to_megatron(bad, out)
    assert no_leftovers(out)


def test_unsupported_architecture_names_the_field(hf_models, tmp_path):
    bad = tmp_path / "mixtral"
    shutil.copytree(hf_models["llama"], bad)
    config = json.loads((bad / "config.json").read_text())
    config.update(model_type="mixtral", architectures=["MixtralForCausalLM"])
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="model_type='mixtral'"):
        hf_to_megatron(bad, tmp_path / "out")
    assert no_leftovers(tmp_path / "out")


@pytest.mark.megatron  # checks the Megatron model's results (a session fixture built it)
def test_existing_output_and_a_config_of_another_model_are_refused(hf_models, rank_results, rank_work, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        hf_to_megatron(hf_models["qwen3"], out)
    # the qwen3 checkpoint with qwen2's config: the differing fields are named before anything is built
    with pytest.raises(MappingError, match="describes a different model than the checkpoint") as error:
        megatron_to_hf(rank_work / "megatron" / "qwen3", tmp_path / "out", hf_models["qwen2"])
    assert "family: 'qwen2' vs 'qwen3'" in str(error.value) and "qkv_bias: True vs False" in str(error.value)
    assert no_leftovers(tmp_path / "out")


def test_a_failure_midway_leaves_no_output(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_output_dir(out) as tmp:
            (tmp / "half-written.safetensors").write_bytes(b"x" * 100)
            raise RuntimeError("disk full")
    assert no_leftovers(out)
    with atomic_output_dir(out) as tmp:
        (tmp / "done").write_text("ok")
    assert (out / "done").read_text() == "ok" and no_leftovers(tmp_path / "other")


def test_a_replaced_copy_stays_whole_when_its_refresh_fails(tmp_path):
    """``replaced_dir`` (one process refreshing its own copy, e.g. the servers' model directory): a failure midway
    leaves the previous copy as it was and no .partial directory; a success replaces it whole."""
    out = tmp_path / "copy"
    with replaced_dir(out) as tmp:
        (tmp / "config.json").write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        with replaced_dir(out) as tmp:
            (tmp / "config.json").write_text("new")
            raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"] and (out / "config.json").read_text() == "old"
    with replaced_dir(out) as tmp:
        (tmp / "config.json").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"] and (out / "config.json").read_text() == "new"


def test_sigterm_midway_leaves_no_output(tmp_path):
    out = tmp_path / "out"
    script = (f"from gspo_megatron.model.atomic import atomic_output_dir, exit_on_sigterm\nimport time\n"
              f"exit_on_sigterm()\nwith atomic_output_dir({str(out)!r}) as tmp:\n"
              f"    (tmp / 'part').write_text('x'); print('writing', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert no_leftovers(out)


# ---- the command-line tools, one process each --------------------------------------------------------------


def run_tool(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    env.pop("WORLD_SIZE", None)
    return warm_cli.run([sys.executable, str(ROOT / "tools" / script), *args], capture_output=True, text=True,
                      cwd=ROOT, env=env, timeout=300)


@pytest.mark.megatron  # the converters build the Megatron model (reported by the warm CLI's probe)
def test_command_line_round_trip_in_one_process(hf_models, tmp_path):
    """The model given as a Hugging Face repo id both ways (--hf-dir, --hf-config): its snapshot in huggingface_hub's
    cache, laid out here and read offline."""
    from tests.model.hub_cache import cached_repo, offline_env

    megatron_dir, back = tmp_path / "qwen3_moe_megatron", tmp_path / "qwen3_moe_back"
    cached_repo(tmp_path / "hub", "org/qwen3-moe", hf_models["qwen3_moe"])
    offline = offline_env(tmp_path / "hub")
    started = time.perf_counter()
    there = run_tool("convert_hf_to_megatron.py", "--hf-dir", "org/qwen3-moe", "--out", str(megatron_dir), env=offline)
    assert there.returncode == 0, there.stderr[-3000:]
    # Without TransformerEngine: our one line, not megatron-core's four import-time warnings.
    assert there.stderr.count("TransformerEngine is not installed") == 1, there.stderr[-3000:]
    assert "Transformer Engine and Apex are not installed" not in there.stderr
    home = run_tool("convert_megatron_to_hf.py", "--megatron-dir", str(megatron_dir), "--out", str(back),
                    "--hf-config", "org/qwen3-moe", env=offline)
    assert home.returncode == 0, home.stderr[-3000:]
    assert_same_hf_checkpoint(hf_models["qwen3_moe"], back)
    assert (back / "model.safetensors").is_file() and not (back / INDEX_FILE).exists()  # small: one file
    assert time.perf_counter() - started < 240


CHAINED = ("qwen3_5_moe", "qwen3_next", "gpt_oss")  # a vision-language hybrid, a causal-LM hybrid, sinks + windows


@pytest.mark.megatron  # the converters and score build the Megatron model (reported by the warm CLI's probe)
@pytest.mark.parametrize("variant", CHAINED)
def test_commands_chain_convert_score_and_back(variant, hf_models, hybrid_models, tmp_path):
    """As a user chains them, one command at a time: convert the HF directory, ``score`` the Megatron directory
    (equal to transformers on the HF directory: fp32, tests/tools/test_score.py's ATOL), convert it back and compare
    every tensor bit for bit (Qwen3.5-MoE's vision tower and both hybrids' mtp.* tensors carried through)."""
    from gspo_megatron.model.hf_config import read_hf_config
    from tests.tools.test_score import _write_records, assert_agrees, transformers_loglik

    hf_dir = hybrid_models[variant] if variant in hybrid_models else hf_models[variant]
    megatron_dir, back = tmp_path / "megatron", tmp_path / "back"
    there = run_tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_dir), "--out", str(megatron_dir))
    assert there.returncode == 0, there.stderr[-3000:]
    records = rank_checks.score_records_for_tests(read_hf_config(hf_dir).vocab_size)
    _write_records(tmp_path / "in.jsonl", records)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    scored = warm_cli.run([sys.executable, "-m", "gspo_megatron.cli", "score", "--model", str(megatron_dir), "--input",
                           str(tmp_path / "in.jsonl"), "--micro-batch-size", "3", "--dtype", "float32"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert_agrees([json.loads(line) for line in scored.stdout.splitlines()], transformers_loglik(hf_dir, records))
    home = run_tool("convert_megatron_to_hf.py", "--megatron-dir", str(megatron_dir), "--out", str(back))
    assert home.returncode == 0, home.stderr[-3000:]
    assert_same_hf_checkpoint(hf_dir, back)
    carried = [n for n in SafetensorsDir(back).shapes() if n.startswith(("mtp.", "model.visual."))]
    assert bool(carried) == (variant != "gpt_oss"), carried


def test_command_line_errors_exit_2_naming_the_problem(hf_models, tmp_path):
    out = tmp_path / "out"
    bad = run_tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_models["qwen3_moe"]), "--out", str(out), "--tp", "3")
    assert bad.returncode == 2
    assert "num_attention_heads=4 is not divisible by tensor_model_parallel_size=3" in bad.stderr
    assert no_leftovers(out)
    # three layers over two stages: only unevenly, and the sentence names the option
    bad = run_tool("convert_hf_to_megatron.py", "--hf-dir", str(hf_models["moonlight"]), "--out", str(out), "--pp", "2",
                   "--first-stage-layers", "3")
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert ("num_hidden_layers=3 minus num_layers_in_first_pipeline_stage=3 leaves 0 layers for the other 1 stage(s)"
            in bad.stderr), bad.stderr[-3000:]
    assert no_leftovers(out)
    # a Hugging Face repo id that is not in the cache, offline: one sentence, no traceback
    from tests.model.hub_cache import offline_env

    offline = offline_env(tmp_path / "empty_hub")
    for script, option, more in (("convert_hf_to_megatron.py", "--hf-dir", []),
                                 ("convert_megatron_to_hf.py", "--hf-config", ["--megatron-dir", str(tmp_path)])):
        bad = run_tool(script, option, "org/absent", "--out", str(out), *more, env=offline)
        assert bad.returncode == 2, bad.stderr[-3000:]
        assert (f"{option} org/absent is not a directory, and as a Hugging Face repo id it is not in the cache and "
                "this machine is offline (HF_HUB_OFFLINE=1)") in bad.stderr and "Traceback" not in bad.stderr
        assert no_leftovers(out)
