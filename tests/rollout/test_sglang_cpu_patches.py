"""patches.sglang_cpu: the pure-torch rotary stand-in equals SGLang's formula; versions other than 0.5.23 are
refused; the stand-ins reach only a CPU server's PYTHONPATH."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import patches.sglang_cpu as sglang_cpu

from .helpers import import_from_cpu_site, require_sglang


def _reference(positions, x, head_size, cos_sin_cache, is_neox):
    """SGLang's RotaryEmbedding.forward_native (apply_rotary_emb) on [T, heads * head_size]."""
    T = x.shape[0]
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    x = x.view(T, -1, head_size)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        x1, x2 = rot[..., ::2], rot[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
    return torch.cat((out, rest), -1).reshape(T, -1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial rotary
def test_rotary_stand_in_equals_sglang_formula(is_neox, rotary_dim):
    require_sglang()
    ops = import_from_cpu_site("vllm._custom_ops")
    g = torch.Generator().manual_seed(0)
    T, head_size = 7, 16
    inv = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.outer(torch.arange(64).float(), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, rotary_dim]
    positions = torch.randint(0, 64, (T,), generator=g)
    q = torch.randn(T, 4 * head_size, generator=g)
    k = torch.randn(T, 2 * head_size, generator=g)
    q_ref, k_ref = _reference(positions, q, head_size, cache, is_neox), _reference(positions, k, head_size, cache, is_neox)
    ops.rotary_embedding(positions, q, k, head_size, cache, is_neox)  # in place
    torch.testing.assert_close(q, q_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(k, k_ref, rtol=0, atol=1e-6)


def test_other_sglang_versions_are_refused(monkeypatch):
    monkeypatch.setattr(sglang_cpu, "installed_version", lambda: "0.5.99")
    with pytest.raises(sglang_cpu.UnsupportedSGLang, match="supports sglang==0.5.23 on CPU, found 0.5.99"):
        sglang_cpu.server_env({}, "cpu")
    monkeypatch.setattr(sglang_cpu, "installed_version", lambda: None)
    with pytest.raises(sglang_cpu.UnsupportedSGLang, match="not installed"):
        sglang_cpu.check_version()


def test_stand_ins_refuse_other_versions_when_imported():
    """The stand-in modules check the version themselves, on the server's side of PYTHONPATH."""
    code = ("import importlib.metadata as m; m.version = lambda name: '0.4.0'; import vllm._custom_ops")
    env = {"PYTHONPATH": str(sglang_cpu.SITE), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "written for sglang==0.5.23 on CPU, found sglang 0.4.0" in out.stderr


def test_stand_ins_only_on_cpu(monkeypatch):
    monkeypatch.setattr(sglang_cpu, "installed_version", lambda: "0.5.23")
    env = sglang_cpu.server_env({"PYTHONPATH": "/x"}, "cpu")
    assert env["PYTHONPATH"].split(":") == [str(sglang_cpu.SITE), "/x"]
    assert sglang_cpu.server_env({"PYTHONPATH": "/x"}, "cuda") == {"PYTHONPATH": "/x"}


def test_torchvision_stand_in_binds_names_and_refuses_calls():
    require_sglang()
    code = ("from torchvision.transforms import InterpolationMode\n"
            "from torchvision.io import decode_image\n"
            "import torchvision.transforms.v2.functional as F\n"
            "assert InterpolationMode.BICUBIC.value == 'bicubic'\n"
            "try:\n    F.resize(1)\nexcept NotImplementedError as e:\n    print(e)\n")
    env = {"PYTHONPATH": str(sglang_cpu.SITE), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "torchvision.transforms.v2.functional.resize was called" in out.stdout


def test_batched_decode_equals_the_per_request_loop():
    """patches/sglang_cpu/site/_gspo_batched_decode: one masked SDPA over all requests == SGLang's loop of one
    SDPA per request (requests of different lengths, scattered cache slots, grouped-query heads)."""
    import importlib
    import sys

    from patches.sglang_cpu import SITE

    sys.path.insert(0, str(SITE))
    try:
        batched = importlib.import_module("_gspo_batched_decode")
    finally:
        sys.path.remove(str(SITE))
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, slots = 8, 2, 16, 400
    k_cache, v_cache = torch.randn(slots, kv_heads, dim, generator=g), torch.randn(slots, kv_heads, dim, generator=g)
    seq_lens = torch.tensor([1, 17, 5, 33, 2])
    req_to_token = torch.randperm(slots, generator=g)[: 10 * 40].view(10, 40)
    req_pool_indices = torch.tensor([7, 0, 3, 9, 4])
    query = torch.randn(len(seq_lens), heads, dim, generator=g)
    expected = torch.empty_like(query)
    for i, (pool, length) in enumerate(zip(req_pool_indices, seq_lens)):  # SGLang's loop, one request at a time
        tokens = req_to_token[pool, :length]
        expected[i] = torch.nn.functional.scaled_dot_product_attention(
            query[i, :, None].unsqueeze(0), k_cache[tokens].movedim(0, 1).unsqueeze(0),
            v_cache[tokens].movedim(0, 1).unsqueeze(0), scale=0.25, enable_gqa=True)[0, :, 0]
    out = batched.batched_decode(query, torch.empty_like(query), k_cache, v_cache, req_to_token, req_pool_indices,
                                 seq_lens, scaling=0.25, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_server_processes_get_the_batched_decode(tmp_path):
    """The site folder's sitecustomize patches sglang's torch_native backend when (and only when) it is imported,
    its host-buffer allocator for CPU devices (unpinned: the routed-experts capture's host cache), and binds the
    gated-DeltaNet stand-ins where the GDN kernel module imports its Triton kernels from, and the block-FP8 layers'
    stand-in into SGLang's FP8 linear and MoE methods."""
    import os
    import subprocess
    import sys

    from patches import sglang_cpu

    require_sglang()
    env = sglang_cpu.server_env(dict(os.environ), "cpu")
    code = ("import sys; assert 'sglang' not in sys.modules; "
            "from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend as B; "
            "print(getattr(B._run_sdpa_forward_decode, '_gspo_batched', False)); "
            "from sglang.srt.mem_cache.pool_host import common as C; "
            "print(C.ALLOC_MEMORY_FUNCS['cpu'].__name__, C.ALLOC_MEMORY_FUNCS['cuda'].__name__); "
            "from sglang.srt.layers.attention.linear.kernels import gdn_triton as T; "
            "from sglang.kernels.ops.mamba import causal_conv1d_triton as K; "
            "print(T.chunk_gated_delta_rule.__module__, T.fused_recurrent_gated_delta_rule_packed_decode.__module__, "
            "T.fused_sigmoid_gating_delta_rule_update.__module__, K.causal_conv1d_update.__module__); "
            "from sglang.srt.layers.quantization import fp8 as F; "
            "print(F.Fp8LinearMethod.apply.__module__, F.Fp8MoEMethod.apply.__module__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-4:] == ["True", "alloc_unpinned alloc_with_host_register",
                                                    " ".join(["_gspo_gated_deltanet"] * 4),
                                                    "_gspo_fp8_block _gspo_fp8_block"], out.stdout


def _library_base(pid: int, name: str) -> int:
    """Where ``name`` (a shared library) is mapped in process ``pid``."""
    for line in open(f"/proc/{pid}/maps"):
        if line.rstrip().endswith(f"/{name}"):
            return int(line.split("-")[0], 16)
    raise AssertionError(f"{name} is not mapped in process {pid}")


def test_a_cpu_servers_scheduler_and_detokenizer_are_forked(engine, started_servers):
    """``_gspo_fork_children``: the session's main server (already up: ``engine``) forked its children. A forked
    child keeps its parent's address-space layout, where an exec'd (spawned) one gets a fresh random one: torch's
    library sits at the launcher's address in both children."""
    from pathlib import Path

    import psutil

    if Path("/proc/sys/kernel/randomize_va_space").read_text().strip() == "0":
        pytest.skip("address-space randomisation is off here: a spawned child would map torch where its parent does")
    _, started = started_servers
    server = started["main"][0]
    children = psutil.Process(server.process.pid).children()
    sglang = [c for c in children if c.name().startswith("sglang::")]
    assert sorted(c.name() for c in sglang) == ["sglang::detokenizer", "sglang::scheduler"], \
        [c.cmdline() for c in children]
    library = "libtorch_cpu.so"
    launcher = _library_base(server.process.pid, library)
    assert all(_library_base(c.pid, library) == launcher for c in sglang)
    assert "scheduler and detokenizer are forked" in server.log_path.read_text()
