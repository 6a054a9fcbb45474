"""megatron-core's TE grouped-linear classes on CPU, with TransformerEngine's ``GroupedLinear`` stood in for.

TransformerEngine cannot be built or imported without CUDA, and megatron-core defines ``TEGroupedLinear``,
``TEColumnParallelGroupedLinear`` and ``TERowParallelGroupedLinear`` (extensions/transformer_engine.py) only when
it imports. ``grouped_linear_classes()`` compiles megatron's own source of those classes (the block under
``if HAVE_TE and is_te_min_version("1.9.0.dev0"):``) against ``GroupedLinear`` below as their base, which does only
what TE's module contributes (TE 2.x ``pytorch/module/grouped_linear.py``): one parameter ``weight{i}`` of shape
[out_features, in_features] per GEMM, registered under exactly that name; TE's extra state, an empty tensor when
FP8 is off; and the grouped GEMM itself, here a loop of matmuls over the split sizes. Everything megatron adds --
the expert-parallel sizes of each GEMM, parameter attributes, the sharded state dict with its expert offsets and
GLU split -- is megatron's code, run as written. So is ``TEGroupedMLP`` (transformer/moe/experts.py), which
imports without TE and is used as is.

``local_spec_with_grouped_experts()`` makes megatron's local spec build MoE experts as that ``TEGroupedMLP``
when ``moe_grouped_gemm`` is set (where TE's spec would): the rest of the model stays on the local spec.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import textwrap
import types
from unittest import mock

import torch

BLOCK_START = 'if HAVE_TE and is_te_min_version("1.9.0.dev0"):'
_classes = None


class GroupedLinear(torch.nn.Module):
    """TE's ``GroupedLinear`` as megatron's wrappers use it, with no FP8 and no communication of its own
    (megatron builds expert GEMMs with ``parallel_mode=None`` and ``tp_size=1`` whenever TP or EP > 1)."""

    def __init__(self, num_gemms, in_features, out_features, *, sequence_parallel=False,
                 fuse_wgrad_accumulation=False, tp_group=None, tp_size=1, get_rng_state_tracker=None,
                 init_method=None, bias=True, return_bias=False, parallel_mode=None, params_dtype=None,
                 device=None, **_other_te_kwargs):
        super().__init__()
        if parallel_mode == "column":
            out_features //= tp_size
        elif parallel_mode == "row":
            in_features //= tp_size
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.fp8 = self.fp8_calibration = False
        self.fp8_meta = {"fp8_checkpoint": False}
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype))
            if init_method is not None:
                init_method(weight)
            self.register_parameter(f"weight{i}", weight)
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.zeros(out_features, dtype=params_dtype)))

    def init_fp8_metadata(self, num_gemms=1):
        pass

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)  # TE's extra state without FP8

    def set_extra_state(self, state):
        pass

    def forward(self, x, m_splits, is_first_microbatch=None):
        outs = []
        for i, rows in enumerate(torch.split(x, list(m_splits))):
            out = rows @ getattr(self, f"weight{i}").T
            outs.append(out + getattr(self, f"bias{i}") if self.use_bias and not self.return_bias else out)
        out = torch.cat(outs) if outs else x.new_empty(0, self.out_features)
        if self.return_bias:
            return out, [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return out


def grouped_linear_classes() -> types.SimpleNamespace:
    """megatron's (TEGroupedLinear, TEColumnParallelGroupedLinear, TERowParallelGroupedLinear) over the stand-in."""
    global _classes
    if _classes is not None:
        return _classes
    from megatron.core.extensions import transformer_engine as te_ext

    source = inspect.getsource(te_ext)
    if BLOCK_START not in source:
        from megatron.core import package_info

        raise RuntimeError(f"megatron-core {package_info.__version__}: no `{BLOCK_START}` block to compile")
    block = source.split(BLOCK_START + "\n", 1)[1]
    body = []
    for line in block.splitlines():
        if line and not line.startswith(" "):  # the block's `else:`
            break
        body.append(line)
    helpers = inspect.getsource(te_ext._get_extra_te_kwargs)
    namespace = dict(vars(te_ext))  # megatron's globals (with patches.megatron_cpu's torch remap)
    namespace.update(
        te=types.SimpleNamespace(pytorch=types.SimpleNamespace(GroupedLinear=GroupedLinear),
                                 common=types.SimpleNamespace(recipe=types.SimpleNamespace(DelayedScaling=type(None)))),
        is_te_min_version=lambda version, check_equality=True: True,  # the stand-in plays TE 2.x
        __name__="tests.model.te_grouped_linear.megatron_te",
    )
    exec(compile(helpers + "\n" + textwrap.dedent("\n".join(body)), te_ext.__file__, "exec"), namespace)
    _classes = types.SimpleNamespace(**{n: namespace[n] for n in (
        "TEGroupedLinear", "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")})
    return _classes


@contextlib.contextmanager
def local_spec_with_grouped_experts():
    """While active, megatron's local spec builds grouped MoE experts as TEGroupedMLP over the classes above."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    classes = grouped_linear_classes()
    original = LocalSpecProvider.grouped_mlp_modules

    def grouped_mlp_modules(self, moe_use_grouped_gemm, *legacy):  # 0.16 also passes moe_use_legacy_grouped_gemm
        if not moe_use_grouped_gemm:
            return original(self, moe_use_grouped_gemm, *legacy)
        if legacy:  # megatron-core 0.16: (module, submodules)
            return TEGroupedMLP, MLPSubmodules(linear_fc1=classes.TEColumnParallelGroupedLinear,
                                               linear_fc2=classes.TERowParallelGroupedLinear)
        from megatron.core.transformer.moe.experts import GroupedMLPSubmodules  # 0.19: a builder

        return functools.partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
            linear_fc1=classes.TEColumnParallelGroupedLinear, linear_fc2=classes.TERowParallelGroupedLinear))

    with mock.patch.object(LocalSpecProvider, "grouped_mlp_modules", grouped_mlp_modules):
        yield
