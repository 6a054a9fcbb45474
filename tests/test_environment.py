"""``gspo_megatron.environment``: the device decision, and refusing an installed stack that does not fit the machine.

The GPU side (a CUDA model and pinned, non-blocking batch copies) runs in bench/gpu_check.sh; here: the GPU
detection from the driver's files, the CPU-torch-on-a-GPU-machine refusal, TransformerEngine's import failing
loudly only on CUDA, batches and every model parameter (megatron's CPU-created router weights included) going to
the one device, and megatron's fallback warnings said once.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_megatron import environment
from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]


def fake_machine(root: Path, gpus: int) -> Path:
    """A root directory with the driver's files for ``gpus`` GPUs."""
    (root / "dev").mkdir(parents=True)
    (root / "dev/nvidiactl").touch()  # not a GPU
    for i in range(gpus):
        (root / "proc/driver/nvidia/gpus" / f"0000:0{i}:00.0").mkdir(parents=True)
        (root / "dev" / f"nvidia{i}").touch()
    return root


def test_gpus_are_counted_from_the_driver(tmp_path):
    assert environment.gpus_on_this_machine(fake_machine(tmp_path / "none", 0)) == 0
    assert environment.gpus_on_this_machine(fake_machine(tmp_path / "eight", 8)) == 8
    only_dev = tmp_path / "dev_only"
    (only_dev / "dev").mkdir(parents=True)
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (only_dev / "dev" / name).touch()
    assert environment.gpus_on_this_machine(only_dev) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a torch that cannot use the GPUs")
def test_cpu_torch_on_a_gpu_machine_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(environment.ALLOW_CPU_ENV, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    environment.check_torch_fits_machine(fake_machine(tmp_path / "cpu_box", 0))  # no GPUs: a CPU run is right
    gpu_box = fake_machine(tmp_path / "gpu_box", 8)
    with pytest.raises(environment.EnvironmentMismatch, match="8 NVIDIA GPU") as error:
        environment.check_torch_fits_machine(gpu_box)
    why = "CPU-only build" if torch.version.cuda is None else "sees none of them"
    assert why in str(error.value) and environment.ALLOW_CPU_ENV in str(error.value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # GPUs hidden on purpose
    environment.check_torch_fits_machine(gpu_box)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv(environment.ALLOW_CPU_ENV, "1")
    environment.check_torch_fits_machine(gpu_box)


def test_cli_names_the_mismatch(tmp_path, monkeypatch, capsys):
    from gspo_megatron import cli

    monkeypatch.delenv(environment.ALLOW_CPU_ENV, raising=False)
    monkeypatch.setattr(environment, "gpus_on_this_machine", lambda root="/": 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = cli.main(["train", str(ROOT / "examples/tiny_moe_cpu.yaml"), f"model.hf_dir={tmp_path / 'm'}",
                     f"logging.dir={tmp_path}"])
    assert code == 2
    assert "this machine has 4 NVIDIA GPU(s)" in capsys.readouterr().err


def _broken_transformer_engine(directory: Path) -> None:
    package = directory / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text("raise OSError('libcuda.so.1: cannot open shared object file')\n")


def test_transformer_engine_falls_back_only_where_right(tmp_path, monkeypatch, request):
    assert environment.transformer_engine_available() is False  # not installed here
    _broken_transformer_engine(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # The fake package must not outlive the test (later tests would find TE "installed"): monkeypatch restores
    # sys.modules entries it replaced, not ones the import adds.
    request.addfinalizer(lambda: [sys.modules.pop(m) for m in list(sys.modules) if m.startswith("transformer_engine")])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert environment.transformer_engine_available() is False  # no CUDA: TE cannot import, local layers are right
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(environment.EnvironmentMismatch, match="does not import on this CUDA machine") as error:
        environment.transformer_engine_available()
    assert "libcuda.so.1" in str(error.value)  # the import error itself


def test_batches_move_to_the_device():
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "mask": torch.ones(2, 4, dtype=torch.bool),
             "note": "kept"}
    moved = environment.to_device(batch, torch.device("meta"))
    assert moved["input_ids"].device.type == "meta" and moved["mask"].device.type == "meta"
    assert moved["mask"].dtype == torch.bool and moved["note"] == "kept"
    assert environment.to_device(batch, torch.device("cpu"))["input_ids"] is batch["input_ids"]  # no copy
    assert environment.device() == (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                    else torch.device("cpu"))


def _build_on(device: str, hf_dir: str) -> dict:
    from unittest import mock

    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.provider import build_gpt_model

    spec = read_hf_config(Path(hf_dir) / "config.json")
    with mock.patch.object(environment, "device", lambda: torch.device(device)):
        model = build_gpt_model(spec, Layout())
    return {name: p.device.type for name, p in model.named_parameters()}


@pytest.mark.megatron  # builds a Megatron model
def test_every_parameter_goes_to_the_device(tmp_path):
    """megatron creates MoE router weights on the CPU whatever the device; the provider moves them (checked with
    the meta device, the one other device a CPU machine has)."""
    from tests.model.hf_tiny import save_variant

    hf_dir = save_variant("qwen3_moe", tmp_path / "qwen3_moe")
    (devices,) = run_on_ranks(_build_on, 1, Layout(), "meta", str(hf_dir))
    assert any("router" in name for name in devices)
    assert set(devices.values()) == {"meta"}, {n: d for n, d in devices.items() if d != "meta"}


def test_megatron_fallback_warnings_are_said_once():
    # A real interpreter (not tests.warm_cli): what it prints while importing megatron-core is the point.
    out = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "plan", "examples/qwen3_30b_a3b/train.yaml",
                          "--nodes", "2", "--gpus-per-node", "8"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "Transformer Engine and Apex are not installed" not in out.stderr  # megatron's four copies: silenced


def test_quiet_start_silences_the_known_noise_here_and_in_child_processes(monkeypatch):
    import os
    import subprocess
    import sys
    import warnings

    from gspo_megatron.environment import quiet_start

    monkeypatch.setenv("PYTHONWARNINGS", "error::ResourceWarning")  # a user's own filters stay, after ours (they win)
    with warnings.catch_warnings():
        quiet_start()
        quiet_start()  # idempotent: no filter added twice
        value = os.environ["PYTHONWARNINGS"]
        assert value.endswith(",error::ResourceWarning") and value.count("Apex is not installed") == 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            quiet_start()
            warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
            warnings.warn("something else", UserWarning)
        assert [str(w.message) for w in caught] == ["something else"]
    child = subprocess.run([sys.executable, "-c", "import warnings; warnings.warn('full scope is deprecated. x'); "
                            "warnings.warn('Please use DTensor instead and we are deprecating ShardedTensor', "
                            "FutureWarning); warnings.warn('kept')"], capture_output=True, text=True)
    assert child.stderr.strip() == "<string>:1: UserWarning: kept", child.stderr


def _setup_kwargs() -> dict:
    """What setup.py passes to setuptools.setup (run with setup() replaced, nothing installed)."""
    import runpy

    import setuptools

    captured = {}
    real = setuptools.setup
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = real
    return captured


def _te_specifier(python: str):
    from packaging.requirements import Requirement

    env = {"python_version": python, "extra": ""}
    reqs = [Requirement(r) for r in _setup_kwargs()["extras_require"]["gpu"]]
    (te,) = [r for r in reqs if r.name == "transformer-engine" and (r.marker is None or r.marker.evaluate(env))]
    assert "pytorch" in te.extras
    return te.specifier


def test_transformer_engine_is_pinned_per_megatron_core_release():
    # Python 3.11 installs megatron-core 0.16.1, which declares >=2.9,<2.12; 3.12 installs 0.19.2, whose source knows
    # TE up to 2.14. pip's newest (2.20.2 when this was written) is admitted by neither.
    for python, admitted, refused in [("3.11", ["2.9.0", "2.11.0"], ["2.8.0", "2.12.0", "2.20.2"]),
                                      ("3.12", ["2.9.0", "2.14.1"], ["2.8.0", "2.15.0", "2.20.2"])]:
        spec = _te_specifier(python)
        assert all(spec.contains(v) for v in admitted), (python, str(spec))
        assert not any(spec.contains(v) for v in refused), (python, str(spec))


def test_our_pin_agrees_with_what_the_installed_megatron_core_declares():
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    declared = [Requirement(r) for r in requires("megatron-core") or []]
    bounded = [r for r in declared if r.name == "transformer-engine" and str(r.specifier)]
    ours = _te_specifier(f"{sys.version_info.major}.{sys.version_info.minor}")
    if version("megatron-core") == "0.16.1":
        assert bounded, "megatron-core 0.16.1 declares a transformer-engine range in its dev extra"
    for requirement in bounded:  # 0.19.2 declares none
        for candidate in ["2.8.0", "2.9.0", "2.10.0", "2.11.0", "2.12.0", "2.14.0", "2.20.2"]:
            assert ours.contains(candidate) == requirement.specifier.contains(candidate, prereleases=True), candidate
