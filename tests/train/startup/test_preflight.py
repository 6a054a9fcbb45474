"""Fail before the expensive part, in sentences: what the config and its files can tell is checked before any model is
built (prompt files, rewards, the model directory's config.json and tensors, a damaged checkpoint on --resume). In
process through the command line's ``main``: each case stops before Megatron is imported into a model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gspo_megatron.cli import main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = str(ROOT / "examples/tiny_moe_cpu.yaml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from gspo_megatron.rewards.synthetic import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _wrong_shape(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with one tensor of the wrong shape."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for file in model_dir.iterdir():
        if file.suffix != ".safetensors":
            (out / file.name).write_bytes(file.read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 5)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


CASES = {
    # name: (files to write, overrides, exit status, message)
    "prompt file: bad JSON line": ({"p.jsonl": '{"prompt": "ab", "answer": "ba"}\n{"prompt": \n'},
                                   ["data.task=", "data.prompts={tmp}/p.jsonl"], 1, "{tmp}/p.jsonl:2: not valid JSON"),
    "prompt file: missing": ({}, ["data.task=", "data.prompts={tmp}/nope.jsonl"], 1,
                             "data.prompts='{tmp}/nope.jsonl' does not exist"),
    "prompt file: prompt too long": ({"p.jsonl": json.dumps({"prompt": "a" * 40, "answer": "x"}) + "\n"},
                                     ["data.task=", "data.prompts={tmp}/p.jsonl"], 1,
                                     "{tmp}/p.jsonl:1: prompt has 40 tokens > rollout.max_prompt_tokens=16"),
    "prompt file: tools on a plain prompt": ({"p.jsonl": json.dumps({"prompt": "ab", "tools": [{"type": "function"}]})
                                              + "\n"}, ["data.task=", "data.prompts={tmp}/p.jsonl"], 1,
                                             "{tmp}/p.jsonl:1: has tools (data.tools_key) but its prompt does not go "
                                             "through the chat template"),
    "code test the grader cannot grade": ({"p.jsonl": json.dumps({"prompt": "ab", "tests": ["assert add(1, 2) == 3"]})
                                           + "\n" + json.dumps({"prompt": "ab", "tests": [
                                               "assert all(add(i, i) == 2 * i for i in range(3))"]}) + "\n"},
                                          ["data.task=", "data.prompts={tmp}/p.jsonl", "data.reward=code_tests"], 1,
                                          "{tmp}/p.jsonl:2: the code test 'assert all(add(i, i) == 2 * i for i in "
                                          "range(3))' compares 'add(i, i) == 2 * i' inside"),
    "prompt file: no label for a built-in reward": (
        {"p.jsonl": json.dumps({"prompt": "ab", "answer": "ba"}) + "\n" + json.dumps({"prompt": "ab", "answr": "ba"})
         + "\n"}, ["data.task=", "data.prompts={tmp}/p.jsonl", "data.reward=exact_match"], 1,
        "{tmp}/p.jsonl:2: no label for data.reward='exact_match': none of answer, label, tests, "
        "reward_model.ground_truth in ['answr', 'prompt'] (data.label_key names another field)"),
    "reward: wrong signature": (
        {}, ["data.reward=tests.rewards.user_rewards:wrong_signature"], 2,
        "data.reward='tests.rewards.user_rewards:wrong_signature' called on the first problem of data.task='reverse' "
        "(prompt '{task_prompt}', a response equal to its label '{task_answer}') raised TypeError: wrong_signature() "
        "takes 2 positional arguments but 3 were given (wrong_signature is defined at {user_rewards}:{defined})"),
    "reward: a bug in the user's line": (
        {"p.jsonl": json.dumps({"prompt": "ab", "answer": "ba"}) + "\n"},
        ["data.task=", "data.prompts={tmp}/p.jsonl", "data.reward=tests.rewards.user_rewards:divides_by_zero"], 2,
        "data.reward='tests.rewards.user_rewards:divides_by_zero' called on the first record of "
        "data.prompts='{tmp}/p.jsonl' (prompt 'ab', a response equal to its label 'ba') raised ZeroDivisionError: "
        "division by zero ({user_rewards}:{failing})"),
    "reward: hangs": ({}, ["data.reward=tests.rewards.user_rewards:hangs", "data.reward_timeout_s=0.5"], 2,
                      "did not return within 0.5 s (data.reward_timeout_s)"),
    "reward: not a number": ({}, ["data.reward=tests.rewards.user_rewards:returns_text"], 2,
                             "returned '1.0' (str), not a finite number"),
    "unknown reward": ({}, ["data.reward=maths"], 2,
                       "data.reward='maths' is neither a built-in (['code_tests', 'exact_match', 'math', 'synthetic'])"),
    "reward module missing": ({}, ["data.reward=no_such_module:fn"], 2,
                              "data.reward='no_such_module:fn': cannot import module 'no_such_module'"),
    "truncated config.json": ({"m/config.json": '{"model_type": "qwen3_moe", "hidden'}, ["model.hf_dir={tmp}/m"], 2,
                              "model.hf_dir: {tmp}/m/config.json:1:29: not valid JSON (Unterminated string starting at); is the file "
                              "truncated?"),
}


def _facts(tmp: Path) -> dict:
    """What the messages name: the reward file and its lines, the example task's first problem."""
    from gspo_megatron.rewards.synthetic import make_problems
    from tests.rewards import user_rewards

    problem = make_problems("reverse", 1, seed=1234)[0]
    return {"tmp": tmp, "user_rewards": user_rewards.__file__, "task_prompt": problem.prompt,
            "task_answer": problem.answer, "defined": user_rewards.wrong_signature.__code__.co_firstlineno,
            "failing": user_rewards.divides_by_zero.__code__.co_firstlineno + 2}


@pytest.mark.parametrize("name", CASES)
def test_errors_before_the_model_is_built(name, model_dir, tmp_path, capsys):
    files, overrides, status, message = CASES[name]
    for file, text in files.items():
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / file).write_text(text)
    args = ["train", EXAMPLE, f"model.hf_dir={model_dir}", f"logging.dir={tmp_path / 'run'}", "checkpoint.dir=",
            *[o.format(tmp=tmp_path) for o in overrides]]
    assert main(args) == status
    err = capsys.readouterr().err
    assert message.format(**_facts(tmp_path)) in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()  # nothing started, nothing written


def test_a_tensor_of_the_wrong_shape_is_named_by_train_and_score(model_dir, tmp_path, capsys):
    bad = _wrong_shape(model_dir, tmp_path / "bad")
    wanted = "model.layers.0.self_attn.o_proj.weight"
    assert main(["train", EXAMPLE, f"model.hf_dir={bad}", f"logging.dir={tmp_path / 'run'}", "checkpoint.dir="]) == 2
    err = capsys.readouterr().err
    assert f"model.hf_dir='{bad}'" in err and wanted in err and "[3, 5]" in err, err
    (tmp_path / "r.jsonl").write_text('{"prompt_ids": [1, 2], "response_ids": [3]}\n')
    assert main(["score", "--model", str(bad), "--input", str(tmp_path / "r.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gspo-megatron score: error:") and wanted in err and "[3, 5]" in err, err


def _checkpoint(directory: Path, step: int) -> Path:
    """A torch_dist checkpoint dir as train/records/checkpoint.py leaves it (files only; no process group, nothing of
    Megatron), and ``latest`` pointing at it."""
    import torch.distributed.checkpoint as dcp

    path = directory / f"step_{step:06d}"
    dcp.save({"w": torch.arange(4096.0)}, checkpoint_id=str(path), no_dist=True)
    torch.save({"trainer": {"step": step}}, path / "common.pt")
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (directory / "latest").write_text(path.name)
    return path


def test_a_damaged_checkpoint_on_resume_names_the_file_and_the_last_intact_step(model_dir, tmp_path, capsys):
    ck = tmp_path / "ck"
    intact = _checkpoint(ck, 2)
    damaged = _checkpoint(ck, 4)
    shard = next(damaged.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])  # a copy cut short
    args = ["train", EXAMPLE, f"model.hf_dir={model_dir}", f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={ck}",
            "--resume"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--resume: the checkpoint {damaged} is damaged: {shard} is cut short (1000 of " in err, err
    assert f"the newest intact checkpoint is {intact}" in err, err
    (damaged / "common.pt").unlink()
    assert main(args) == 2
    assert f"{damaged / 'common.pt'} is missing" in capsys.readouterr().err
    (ck / "latest").write_text(intact.name)
    from gspo_megatron.train.records.checkpoint import check_resumable

    check_resumable(ck)  # the intact one passes


def test_attached_servers_that_refuse_connections_are_named_before_the_model_is_built(model_dir, tmp_path, capsys):
    import socket
    import time

    from gspo_megatron.train.startup.bootstrap import wait_for_urls

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, not listening: refuses
        args = ["train", EXAMPLE, f"model.hf_dir={model_dir}", f"logging.dir={tmp_path / 'run'}", "checkpoint.dir=",
                f"rollout.urls=[{dead}]", "rollout.attached_wait_s=2"]
        start = time.monotonic()
        assert main(args) == 2
        waited = time.monotonic() - start
        out = capsys.readouterr()
        assert f"rollout.urls: ['{dead}'] refuse connections (waited 2 s: rollout.attached_wait_s)" in out.err, out.err
        assert f"waiting up to 2 s more for ['{dead}'] to accept connections" in out.out, out.out
        assert 2 <= waited < 30 and not (tmp_path / "run").exists()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        wait_for_urls([f"http://127.0.0.1:{server.getsockname()[1]}"], 0)  # accepts: no wait, no error


@pytest.mark.parametrize("override", ["data.reward=code_tests", "rollout.env=python"])
def test_a_host_that_cannot_confine_programs_refuses_the_code_sandbox(override, model_dir, tmp_path, capsys,
                                                                       monkeypatch):
    """Where the kernel refuses user namespaces (simulated: the probe's answer), the code reward and the Python
    tool stop the run at start naming the option that accepts the risk, rather than run programs unconfined."""
    from gspo_megatron.rewards import sandbox

    monkeypatch.setattr(sandbox, "confinement_unavailable", lambda: "unshare (user namespaces): Operation not "
                                                                    "permitted")
    monkeypatch.setenv(sandbox.MODE_VARIABLE, "confined")  # (restored after)
    args = ["train", EXAMPLE, f"model.hf_dir={model_dir}", f"logging.dir={tmp_path / 'run'}", "checkpoint.dir=",
            override]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert ("the code sandbox cannot confine programs on this host (unshare (user namespaces): Operation not "
            "permitted)" in err and "set data.sandbox=unconfined to accept that risk" in err), err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
    assert main([*args, "data.sandbox=uncontained"]) == 2
    assert "data.sandbox='uncontained' is not one of ('confined', 'unconfined')" in capsys.readouterr().err


def test_a_hugging_face_repo_id_is_read_from_the_hub_cache_offline(model_dir, tmp_path, capsys, monkeypatch):
    """model.hf_dir=org/name (on the command line or in a YAML), nothing of that name on disk: the snapshot in
    huggingface_hub's cache (a cache laid out here, offline: nothing can be downloaded), read as a directory is (its
    wrong tensor named at its snapshot path); a repo not in the cache is one sentence saying so."""
    from tests.model.hub_cache import cached_repo, offline_env

    snapshot = cached_repo(tmp_path / "hub", "org/tiny", _wrong_shape(model_dir, tmp_path / "bad"))
    for name, value in offline_env(tmp_path / "hub").items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("model:\n  hf_dir: org/tiny\ndata:\n  task: reverse\n")
    for args in (["train", EXAMPLE, "model.hf_dir=org/tiny", "model.tiny=null"], ["train", str(tmp_path / "run.yaml")]):
        assert main([*args, f"logging.dir={tmp_path / 'run'}", "checkpoint.dir="]) == 2
        err = capsys.readouterr().err
        assert f"model.hf_dir='{snapshot}'" in err and "model.layers.0.self_attn.o_proj.weight" in err, err
    assert main(["plan", str(tmp_path / "run.yaml")]) == 0  # the plan reads the cached config.json
    out = capsys.readouterr().out
    assert out.startswith("model: qwen3_moe") and "vocab 128" in out, out
    assert main(["train", EXAMPLE, "model.hf_dir=org/elsewhere", "model.tiny=null", f"logging.dir={tmp_path / 'run'}",
                 "checkpoint.dir="]) == 2
    assert ("model.hf_dir='org/elsewhere' is not a directory, and as a Hugging Face repo id it is not in the cache "
            "and this machine is offline (HF_HUB_OFFLINE=1)") in capsys.readouterr().err
