"""megatron-core's GatedDeltaNet without flash-linear-attention (fla): its kernels as pure torch, for the CPU.

megatron's ``GatedDeltaNet`` (Qwen3-Next / Qwen3.5's linear-attention layers) imports fla's Triton kernels at module
level and raises ImportError at build without them; fla needs a GPU. Its own pure-torch rule
(``torch_chunk_gated_delta_rule``) runs only in deterministic mode, which 0.19.2 refuses packed sequences in, and has
no ``cu_seqlens``. ``apply()`` puts ``gspo_megatron.ops.gated_delta_rule`` (the chunked rule with packed sequences,
the causal convolution restarting at each packed sequence, fla's ``l2norm``) where megatron's module looked up fla's
names, so the real ``GatedDeltaNet`` code runs around them. The GPU keeps fla's kernels: the model provider applies
this only without CUDA (``model.provider.megatron_patches``).

Versions (``APPLIES_TO``); any other is refused, naming these:
- 0.16.1: ``megatron.core.ssm.gated_delta_net`` (one module): ``HAVE_FLA``, ``chunk_gated_delta_rule``, ``l2norm``.
  Its convolution is ``nn.Conv1d`` without the ``causal_conv1d`` package, already torch. It refuses packed sequences
  itself (``NotImplementedError``: "GDN does not support packed sequence"), and its forward has no ``cu_seqlens``:
  ``segments_bound`` runs one call of it with its two token-mixing steps (``causal_conv1d_fn``,
  ``chunk_gated_delta_rule``) bound to a packed row's segments (``model.gated_deltanet.PackedGatedDeltaNet``).
- 0.19.2: the ``megatron.core.ssm.gated_delta_net`` package: ``common.HAVE_FLA`` and ``common.l2norm``,
  ``gdn.chunk_gated_delta_rule`` and ``gdn.causal_conv1d`` (fla's ``[b, s, d]`` convolution API, with
  ``cu_seqlens``); packed sequences (THD) pass ``cu_seqlens`` to both.
"""

from __future__ import annotations

import contextlib
import functools

APPLIES_TO = ("0.16.1", "0.19.2")


class MegatronVersionError(RuntimeError):
    pass


def installed_version() -> str:
    from megatron.core import package_info

    return package_info.__version__.split("+")[0]  # 0.19 appends "+<git hash>" of an enclosing repository


def _check(version: str) -> None:
    if version not in APPLIES_TO:
        raise MegatronVersionError(
            f"patches.megatron_gated_deltanet: written for megatron-core {', '.join(APPLIES_TO)}'s GatedDeltaNet, "
            f"this is {version}: install one of those, or run the gated-DeltaNet models on a GPU with "
            "flash-linear-attention")


def gated_delta_net_classes():
    """(GatedDeltaNet, GatedDeltaNetSubmodules) of the installed megatron-core (refused for untested versions)."""
    _check(installed_version())
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules

    return GatedDeltaNet, GatedDeltaNetSubmodules


def _fla_causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                       cu_seqlens=None, **unused):
    """fla's ``causal_conv1d`` API (x [b, s, d] -> ([b, s, d], final state)) over ``ops.gated_delta_rule``'s."""
    from gspo_megatron.ops.gated_delta_rule import causal_conv1d

    if initial_state is not None or output_final_state:
        raise NotImplementedError("the torch causal_conv1d keeps no state between calls (training has none)")
    return causal_conv1d(x.transpose(1, 2), weight, bias, activation, cu_seqlens).transpose(1, 2), None


def apply(version: str | None = None) -> bool:
    """Install the torch kernels where fla is missing. Idempotent; returns whether it changed anything (False where
    fla imported: its kernels stay)."""
    import importlib

    from gspo_megatron.ops import gated_delta_rule as ops

    version = version or installed_version()
    _check(version)
    if version == "0.16.1":
        module = importlib.import_module("megatron.core.ssm.gated_delta_net")
        if module.HAVE_FLA:
            return False
        module.chunk_gated_delta_rule, module.l2norm = ops.chunk_gated_delta_rule, ops.l2norm
        module.HAVE_FLA = True
        return True
    common = importlib.import_module("megatron.core.ssm.gated_delta_net.common")
    gdn = importlib.import_module("megatron.core.ssm.gated_delta_net.gdn")
    if common.HAVE_FLA:
        return False
    common.l2norm = ops.l2norm
    gdn.chunk_gated_delta_rule, gdn.causal_conv1d = ops.chunk_gated_delta_rule, _fla_causal_conv1d
    common.HAVE_FLA = True
    return True


@contextlib.contextmanager
def segments_bound(offsets):
    """0.16.1: for the calls inside, its ``GatedDeltaNet.forward`` convolves and runs the rule over each segment of
    ``offsets`` (int [segments + 1] into a row of one sequence dimension) from a fresh state: the module globals it
    looks both up by, ``causal_conv1d_fn`` ([b, d, s], the torch convolution of ``ops.gated_delta_rule``) and
    ``chunk_gated_delta_rule`` (ours, or fla's on a GPU: both take ``cu_seqlens``), bound to them, then restored."""
    import importlib

    from gspo_megatron.ops.gated_delta_rule import causal_conv1d

    if installed_version() != "0.16.1":
        raise MegatronVersionError("segments_bound is for megatron-core 0.16.1 (0.19.2 passes cu_seqlens itself)")
    module = importlib.import_module("megatron.core.ssm.gated_delta_net")
    saved = module.causal_conv1d_fn, module.chunk_gated_delta_rule
    module.causal_conv1d_fn = functools.partial(causal_conv1d, cu_seqlens=offsets)
    module.chunk_gated_delta_rule = functools.partial(saved[1], cu_seqlens=offsets)
    try:
        yield
    finally:
        module.causal_conv1d_fn, module.chunk_gated_delta_rule = saved
