"""patches.megatron_no_te: megatron-core 0.16.1 without TransformerEngine names ``te_general_gemm`` in its router.

On 0.16.1 the unpatched module raises the issue's NameError at the first router call and the patch mends it; on
0.19.2 (this file re-runs there) the module defines the name and the patch changes nothing. The model provider
applies it for every build without TE, on CUDA too: its decision is a function of (use_te, cuda), tested for the
GPU case here on a CPU machine.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from patches import megatron_cpu, megatron_no_te
from tests.model import hf_tiny


def _fresh_moe_utils(monkeypatch):
    """megatron's moe_utils imported anew (as megatron ships it, no patch made); restored at the test's end."""
    name = "megatron.core.transformer.moe.moe_utils"
    parent = importlib.import_module(name.rpartition(".")[0])
    monkeypatch.setattr(parent, "moe_utils", parent.moe_utils)
    monkeypatch.delitem(sys.modules, name)
    return importlib.import_module(name)


def _router_logits(moe_utils):
    inp, weight = torch.randn(3, 8), torch.randn(4, 8)
    out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    torch.testing.assert_close(out, inp @ weight.t(), rtol=1e-6, atol=1e-6)


@pytest.mark.megatron
def test_mends_0_16_1_and_leaves_0_19_2_alone(monkeypatch):
    megatron_cpu.apply()  # CPU stand-ins for megatron's torch.cuda calls; moe_utils itself is left unpatched
    fresh = _fresh_moe_utils(monkeypatch)
    version = megatron_no_te.installed_version()
    assert version in megatron_no_te.APPLIES_TO + megatron_no_te.DEFINES_IT
    if version in megatron_no_te.APPLIES_TO:
        assert not hasattr(fresh, "te_general_gemm")
        with pytest.raises(NameError, match="te_general_gemm"):  # the crash, on any device
            _router_logits(fresh)
        assert megatron_no_te.apply(fresh) is True
    else:
        assert fresh.te_general_gemm is None
        assert megatron_no_te.apply(fresh) is False
    assert fresh.te_general_gemm is None
    _router_logits(fresh)
    assert megatron_no_te.apply(fresh) is False  # idempotent


def test_refuses_an_untested_version_that_lacks_the_name():
    with pytest.raises(megatron_no_te.MegatronVersionError, match=r"0\.17\.0.*written for 0\.16\.1"):
        megatron_no_te.apply(types.SimpleNamespace(), version="0.17.0")
    # TE imported (the name is TE's gemm): nothing to mend, whatever the version
    assert megatron_no_te.apply(types.SimpleNamespace(te_general_gemm=print), version="0.17.0") is False


def test_every_build_without_te_gets_it_on_cuda_too():
    from gspo_megatron.model.provider import megatron_patches

    assert megatron_patches(use_te=False, cuda=True) == [megatron_no_te]
    assert megatron_patches(use_te=False, cuda=False) == [megatron_cpu, megatron_no_te]
    assert megatron_patches(use_te=True, cuda=True) == []


def _build_and_route(hf_dir: str) -> dict:
    from gspo_megatron.model import provider
    from gspo_megatron.model.hf_config import read_hf_config

    decisions = []
    real = provider.megatron_patches
    provider.megatron_patches = lambda use_te, cuda, **kw: decisions.append((use_te, cuda)) or real(use_te, cuda, **kw)
    model = provider.build_gpt_model(read_hf_config(f"{hf_dir}/config.json"), Layout(), use_te=False, init=True)
    ids = torch.randint(0, 128, (1, 6))
    logits = model(ids, torch.arange(6)[None], attention_mask=None)
    return dict(decisions=decisions, finite=bool(torch.isfinite(logits).all()), cuda=torch.cuda.is_available())


@pytest.mark.megatron
def test_the_provider_applies_the_decision_and_the_router_runs(tmp_path):
    hf_dir = hf_tiny.save_variant("qwen3_moe", tmp_path)  # layer 0 is MoE: its router runs in the forward
    (result,) = run_on_ranks(_build_and_route, 1, Layout(), str(hf_dir))
    assert result["decisions"] == [(False, result["cuda"])]
    assert result["finite"]
