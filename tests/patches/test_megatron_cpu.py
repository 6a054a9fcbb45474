"""patches.megatron_cpu: version gate, idempotence, scoping, and the patched functions' behaviour.

The model-level proof (every layout equals world=1) is tests/parallel/test_megatron_layouts.py; these run
in-process and check the pieces directly.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from patches import megatron_cpu


@pytest.fixture(scope="module", autouse=True)
def applied():
    megatron_cpu.apply()


def test_refuses_an_untested_version(monkeypatch):
    monkeypatch.setattr(megatron_cpu, "_installed_megatron_version", lambda: "0.99.0")
    monkeypatch.setattr(megatron_cpu, "_applied", False)
    # The release to install is the one this Python can get: 0.17+ require Python >= 3.12.
    suggested = "0.19.2" if sys.version_info >= (3, 12) else "0.16.1"
    with pytest.raises(megatron_cpu.MegatronVersionError, match=rf"0\.99\.0.*megatron-core=={suggested}"):
        megatron_cpu.apply()


def test_version_ignores_the_git_hash_megatron_appends(monkeypatch):
    # 0.19's package_info appends "+<hash>" of any git repository around site-packages (a venv in a project).
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", f"{package_info.__shortversion__}+a2b87de")
    assert megatron_cpu._installed_megatron_version() == package_info.__shortversion__
    assert megatron_cpu._installed_megatron_version() in megatron_cpu.TESTED_MEGATRON_VERSIONS


def _fresh_import(name: str, monkeypatch):
    """Import megatron module ``name`` anew through the import system; the test's end restores the old one."""
    parent_name, _, child = name.rpartition(".")
    parent = importlib.import_module(parent_name)
    monkeypatch.setattr(parent, child, getattr(parent, child))
    monkeypatch.delitem(sys.modules, name)
    return importlib.import_module(name)


def test_modules_loaded_after_apply_are_remapped(monkeypatch):
    from megatron.core import utils as mutils

    fresh = _fresh_import("megatron.core.transformer.moe.moe_utils", monkeypatch)
    assert fresh.torch is mutils.torch and fresh.torch is not torch


def test_version_specific_patch_is_made_exactly_where_megatron_needs_it(monkeypatch):
    # te_general_gemm: 0.16.1 only names it when TransformerEngine imports (NameError in the router's gemm),
    # 0.19 defines it as None itself. A fresh import of moe_utils shows what this version does unpatched.
    version = megatron_cpu._installed_megatron_version()
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None
    needed = not hasattr(_fresh_import("megatron.core.transformer.moe.moe_utils", monkeypatch), "te_general_gemm")
    assert ("_define_te_general_gemm" in megatron_cpu.patches_for(version)) == needed


def test_idempotent_and_scoped_to_megatron():
    from megatron.core import utils as mutils
    from megatron.core.tensor_parallel import mappings

    gather = mappings._gather_along_first_dim
    megatron_cpu.apply()
    assert mappings._gather_along_first_dim is gather
    assert mutils.torch is not torch and mutils.torch.cuda.current_device() == torch.device("cpu")
    # Nothing outside megatron sees the remap: torch itself and other libraries keep the real module.
    import torch.nn.functional as F

    assert torch.cuda.current_device is not mutils.torch.cuda.current_device
    assert F.torch is torch if hasattr(F, "torch") else True


def test_remapped_factories_and_device():
    from megatron.core import utils as mutils

    t = mutils.torch
    assert t.zeros(3, device="cuda").device.type == "cpu"
    assert t.tensor([1.0], device=torch.device("cuda", 0), pin_memory=True).device.type == "cpu"
    assert t.empty(2, device=0).device.type == "cpu"
    assert t.device("cuda") == torch.device("cpu") and isinstance(torch.device("cpu"), t.device)
    assert t.device("cpu", 0) == torch.device("cpu", 0)
    assert t.Tensor is torch.Tensor and t.float32 is torch.float32


def test_global_memory_buffer_allocates_on_cpu():
    from megatron.core.utils import GlobalMemoryBuffer

    buf = GlobalMemoryBuffer().get_tensor((4, 8), torch.float32, "mpu")
    assert buf.shape == (4, 8) and buf.device.type == "cpu"


def test_rng_tracker_forks_the_cpu_generator_and_restores_it():
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()
    torch.manual_seed(0)
    tracker.add("model-parallel-rng", 123)
    before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        inside = torch.rand(3)
    assert torch.equal(before, torch.get_rng_state()), "fork must restore the caller's RNG state"
    torch.manual_seed(123)
    assert torch.equal(inside, torch.rand(3)), "the forked stream is the tracker's seed"


def test_norm_accepts_sequence_parallel_and_tags_params():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
        tensor_model_parallel_size=2, sequence_parallel=True,
    )
    norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert all(p.sequence_parallel for p in norm.parameters())
    assert config.sequence_parallel, "the config must be left as it was"


def test_split_sizes_become_a_list():
    from megatron.core.transformer.moe import moe_utils

    sizes = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert list(sizes) == [3, 1]


def _uneven_collectives():
    megatron_cpu.apply()
    from megatron.core.tensor_parallel import mappings

    group = torch.distributed.group.WORLD
    rank = torch.distributed.get_rank()
    sizes = [3, 1]
    mine = torch.full((sizes[rank], 2), float(rank + 1))
    gathered = mappings._gather_along_first_dim(mine, group, output_split_sizes=sizes)
    full = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (rank + 1)
    scattered = mappings._reduce_scatter_along_first_dim(full, group, input_split_sizes=sizes)
    return gathered, scattered


def test_uneven_gather_and_reduce_scatter_on_gloo():
    from gspo_megatron.parallel.launch import run_on_ranks

    results = run_on_ranks(_uneven_collectives, 2, None)
    expected_gather = torch.tensor([[1.0, 1.0]] * 3 + [[2.0, 2.0]])
    full_sum = torch.arange(8, dtype=torch.float32).reshape(4, 2) * 3  # rank factors 1 + 2
    for rank, (gathered, scattered) in enumerate(results):
        torch.testing.assert_close(gathered, expected_gather, rtol=0, atol=0)
        torch.testing.assert_close(scattered, full_sum[:3] if rank == 0 else full_sum[3:], rtol=0, atol=0)
