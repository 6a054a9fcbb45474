"""Runs never mixed or lost: a used logging.dir / checkpoint.dir without --resume is refused before anything is
written, --resume says when there is nothing to resume, output dirs are checked writable before the model is built.
In process (the command line's ``main``, then ``check_run_dirs``): nothing of Megatron is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gspo_megatron.cli import main
from gspo_megatron.train.startup.config import ConfigError, load_config
from gspo_megatron.train.startup.run_dirs import check_resumed_layout, check_run_dirs

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = str(ROOT / "examples/tiny_moe_cpu.yaml")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"" for p in sorted(root.rglob("*"))}


def _earlier_run(root: Path, metrics=True, checkpoints=True) -> None:
    (root / "run").mkdir()
    if metrics:
        (root / "run/metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    if checkpoints:
        (root / "run/ck/step_000002").mkdir(parents=True)
        (root / "run/ck/latest").write_text("step_000002")


def _args(root: Path) -> list[str]:
    return ["train", EXAMPLE, f"model.hf_dir={root / 'model'}", f"logging.dir={root / 'run'}",
            f"checkpoint.dir={root / 'run/ck'}"]


@pytest.mark.parametrize("metrics,checkpoints,named", [
    (True, True, ["metrics.jsonl (2 logged steps)", "checkpoints step_000002"]),
    (True, False, ["metrics.jsonl (2 logged steps)"]),
    (False, True, ["checkpoints step_000002"]),
])
def test_a_used_run_dir_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch, metrics, checkpoints,
                                                              named):
    _earlier_run(tmp_path, metrics, checkpoints)
    before = _files(tmp_path)
    assert main(_args(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "already hold a run" in err and all(n in err for n in named), err
    assert "--resume" in err and "another logging.dir / checkpoint.dir" in err and "--overwrite" in err, err
    assert _files(tmp_path) == before  # nothing written: no model built, no metrics appended
    monkeypatch.setenv("LOCAL_RANK", "1")  # under torchrun the node's other ranks refuse too, without repeating it
    assert main(_args(tmp_path)) == 2 and capsys.readouterr().err == ""


@pytest.mark.parametrize("field,value,message", [
    ("logging.dir", "{tmp}/a_file/run", "logging.dir='{tmp}/a_file/run' cannot be created: {tmp}/a_file is a file"),
    ("logging.dir", "/proc/gspo_run", "logging.dir='/proc/gspo_run' is not writable: cannot write in /proc"),
    ("checkpoint.dir", "/proc/gspo_ck", "checkpoint.dir='/proc/gspo_ck' is not writable: cannot write in /proc"),
    ("model.hf_dir", "/proc/gspo/model", "model.hf_dir='/proc/gspo' is not writable: cannot write in /proc"),
])
def test_an_output_dir_that_cannot_be_written_is_refused_before_the_model_is_built(tmp_path, capsys, field, value,
                                                                                    message):
    (tmp_path / "a_file").write_text("")
    args = _args(tmp_path)[:3] + [f"logging.dir={tmp_path / 'run'}", "checkpoint.dir=",
                                  f"{field}={value.format(tmp=tmp_path)}"]
    assert main(args) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
    assert not (tmp_path / "model").exists()


def test_resume_says_when_there_is_nothing_to_resume_and_contradictions_are_refused(tmp_path):
    cfg = load_config(EXAMPLE, [f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'chekpoints'}"])
    note = check_run_dirs(cfg, resume=True, overwrite=False)
    assert note == (f"gspo-megatron train: --resume: checkpoint.dir={tmp_path / 'chekpoints'} does not exist: "
                    "nothing to resume, starting at step 1")
    (tmp_path / "chekpoints").mkdir()
    assert "holds no checkpoint (no latest): nothing to resume" in check_run_dirs(cfg, resume=True, overwrite=False)
    with pytest.raises(ConfigError, match="--resume and --overwrite contradict"):
        check_run_dirs(cfg, resume=True, overwrite=True)
    with pytest.raises(ConfigError, match="--resume needs checkpoint.dir"):
        check_run_dirs(load_config(EXAMPLE, ["checkpoint.dir="]), resume=True, overwrite=False)


def test_overwrite_removes_the_earlier_run_and_a_restarted_worker_continues_its_own(tmp_path):
    _earlier_run(tmp_path)
    (tmp_path / "run/model").mkdir()  # the model built there is kept
    cfg = load_config(EXAMPLE, [f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'run/ck'}"])
    assert check_run_dirs(cfg, resume=False, overwrite=False, restarted=True) is None  # torchrun --max-restarts
    note = check_run_dirs(cfg, resume=False, overwrite=True)
    assert note.startswith("gspo-megatron train: --overwrite: removed the earlier run's") and "2 logged steps" in note
    assert sorted(_files(tmp_path / "run")) == ["ck", "model"]
    assert check_run_dirs(cfg, resume=False, overwrite=False) is None  # now unused


def test_resume_under_another_model_split_is_refused_naming_the_fields(tmp_path):
    """The layout a step dir was saved with (its gspo_megatron.json) against the config's: the data-parallel size and
    an expert_tensor left to follow tensor may differ, the model's split may not. Through the CLI on a real EP2
    checkpoint: tests/train/resilience/test_preemption.py."""
    step = tmp_path / "step_000002"
    step.mkdir()
    saved = {"tensor": 2, "pipeline": 1, "expert": 2, "context": 1, "expert_tensor": None, "sequence_parallel": True,
             "first_stage_layers": None, "last_stage_layers": None}
    (step / "gspo_megatron.json").write_text(json.dumps({"saved_layout": saved}))
    check_resumed_layout(step, load_config(EXAMPLE, ["parallel.tensor=2", "parallel.expert=2",
                                                     "parallel.expert_tensor=2"]))
    with pytest.raises(ConfigError) as error:
        check_resumed_layout(step, load_config(EXAMPLE, ["parallel.tensor=1", "parallel.expert=4"]))
    assert str(error.value).startswith(f"--resume: {step} was saved under another layout: parallel.tensor=1 (saved "
                                       "with 2), parallel.expert=4 (saved with 2), parallel.expert_tensor=1 (saved "
                                       "with 2). ")
    assert f"model.megatron_checkpoint={step}" in str(error.value)
