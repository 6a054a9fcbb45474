"""Run megatron-core on CPU with the gloo backend.

megatron-core assumes a CUDA device throughout: ``torch.cuda.current_device()`` as an allocation device,
literal ``device="cuda"``, CUDA streams/events/RNG, ``Tensor.type() == "torch.cuda.FloatTensor"`` checks,
and a few gloo-incompatible collectives. ``apply()`` makes the tested versions (``TESTED_MEGATRON_VERSIONS``:
0.16.1 and 0.19.2) run on CPU so that tests use the real Megatron-Core code paths (models, TP/PP/EP/CP
mappings, schedules, DDP, optimizers, dist checkpointing) with real ``torch.distributed``. Any other version
is refused with a message naming the one to install.

What it changes, from broad to narrow:

1. A module-scoped device remap (all tested versions). Each ``megatron.core.*`` module's global name
   ``torch`` is replaced by ``_TorchOnCpu``, a proxy that forwards everything to the real ``torch`` except
   ``torch.cuda`` (a CPU stand-in: ``current_device()`` is the CPU, streams/events are no-ops, RNG calls use
   the CPU generator), ``torch.device("cuda"...)`` (gives the CPU) and tensor factories (a CUDA ``device``
   argument becomes the CPU). This is a remap of ~200 call sites, which no list of narrow patches would
   keep up with; it is scoped to megatron's own module globals, so torch and every other library are
   untouched. Modules loaded before ``apply()`` are swept; later ones are remapped as they load, by a
   meta-path finder that only looks at ``megatron.core.*`` names (megatron imports many modules lazily,
   e.g. 0.19's checkpoint writer, and which ones differs by version). A ``TorchFunctionMode`` would not do:
   it is inactive inside ``autograd.Function.backward`` where many of these calls live.
2. ``torch.Tensor.cuda`` returns the tensor itself (all tested versions: there is no CUDA device to move to,
   and megatron calls ``.cuda()`` on checkpoint loads, RoPE tables and tied embeddings). This is the one
   process-wide change; it is only made when CUDA is absent, where ``.cuda()`` could only have raised.
3. Narrow patches of named functions, each registered with ``@_applies_to(versions)``:
   - ``tensor_parallel.random._get_cuda_rng_state/_set_cuda_rng_state`` (0.16.1, 0.19.2): use the CPU
     generator (the CUDA versions defer through ``torch.cuda._lazy_call``, which never runs without CUDA).
   - ``WrappedTorchNorm`` (0.16.1, 0.19.2): allow sequence parallelism and tag the norm parameters
     ``sequence_parallel`` so ``finalize_model_grads`` all-reduces their gradients across TP (TENorm does the
     same on GPU).
   - ``moe_utils.te_general_gemm`` (0.16.1 only): defined as ``None`` when TransformerEngine is absent
     (a NameError in 0.16.1; 0.19 defines it itself): ``patches.megatron_no_te``, which CUDA runs without TE
     get from the model provider.
   - ``multi_latent_attention.HAVE_TE`` (0.16.1 only): the TE extension's own flag (MLA sets it True whenever the
     extension imports, which it does without TE, and then calls ``isinstance`` with a MagicMock class).
   - ``moe_utils.maybe_move_tensor_to_cpu`` (0.16.1, 0.19.2): honour ``as_numpy`` for CPU tensors, so split
     sizes reach ``all_to_all_single`` as a list, not a tensor.
   - ``tensor_parallel.mappings._gather_along_first_dim/_reduce_scatter_along_first_dim`` (0.16.1, 0.19.2)
     with uneven split sizes (TP x EP with the alltoall dispatcher): gloo rejects per-rank chunks of
     different sizes, so the chunks are padded to the largest one.
   - ``MLASelfAttention.get_query_key_value_tensors`` (0.16.1, 0.19.2): under the local spec's column-parallel down
     projections, the shared rope key's gradient is summed over TP ranks (megatron forgets to); likewise 0.19.2's
     ``AbsorbedMLASelfAttention`` (DeepSeek sparse attention).
   - Optimizer constructors and ``clip_grad_by_total_norm_fp32`` (0.16.1, 0.19.2), which test
     ``param.type()`` against ``"torch.cuda.*Tensor"`` strings, are recompiled from their source with the CPU
     type names.

One module although long: it is one patch, megatron-core on CPU, made by one ``apply()`` behind one version check,
and the list above is the map of everything it changes; the code below follows its numbering.
The seam a split would take is part 1, the device remap (``_TorchOnCpu`` and its import hook), which ``apply()``
reaches only through ``_remap_on_import`` and ``_remap_megatron_modules``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import textwrap
import types
from typing import Callable

import torch

# megatron-core releases this module was run against (the full test suite, tests/test_megatron_019.py for
# 0.19.2). 0.16.1 is the last release for Python 3.11; 0.17 onwards require Python >= 3.12.
TESTED_MEGATRON_VERSIONS = ("0.16.1", "0.19.2")

_applied = False
_real_torch = torch


class MegatronVersionError(RuntimeError):
    pass


def _installed_megatron_version() -> str:
    from megatron.core import package_info

    # 0.19 appends "+<git hash>" of whatever repository encloses site-packages (a venv inside a project).
    return package_info.__version__.split("+")[0]


def _check_version() -> str:
    version = _installed_megatron_version()
    if version not in TESTED_MEGATRON_VERSIONS:
        # The newest tested release this Python can install (0.17+ declare Requires-Python >= 3.12).
        suggested = TESTED_MEGATRON_VERSIONS[-1] if sys.version_info >= (3, 12) else TESTED_MEGATRON_VERSIONS[0]
        raise MegatronVersionError(
            f"patches.megatron_cpu was tested with megatron-core {', '.join(TESTED_MEGATRON_VERSIONS)}, "
            f"but {version} is installed. Install megatron-core=={suggested} (tools/install.sh does), "
            "or run on a CUDA machine where no patch is needed."
        )
    return version


# --------------------------------------------------------------------------------------------------
# 1. The module-scoped remap
# --------------------------------------------------------------------------------------------------

_CPU = _real_torch.device("cpu")


def _is_cuda_device(device) -> bool:
    if isinstance(device, _real_torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_device_arg(device):
    return _CPU if _is_cuda_device(device) else device


def _on_cpu(fn: Callable) -> Callable:
    """Wrap a tensor factory so a CUDA ``device`` argument means the CPU (and pinning is dropped)."""

    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device_arg(kwargs["device"])
        # Pinned host memory needs an accelerator runtime; on a CPU-only machine it is meaningless.
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return factory


_FACTORIES = (
    "tensor as_tensor empty empty_like empty_strided zeros zeros_like ones ones_like full full_like "
    "arange linspace rand randn randint randperm eye"
).split()


class _DeviceMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _real_torch.device)


class _Device(metaclass=_DeviceMeta):
    """``torch.device`` as megatron sees it: any CUDA device is the CPU."""

    def __new__(cls, type_or_str, index=None):
        if isinstance(type_or_str, _real_torch.device):
            return _cpu_device_arg(type_or_str)
        if _is_cuda_device(type_or_str):
            return _CPU
        if index is None:
            return _real_torch.device(type_or_str)
        return _real_torch.device(type_or_str, index)


class _NullStream:
    """A CUDA stream stand-in: CPU ops run in program order, so every wait is already satisfied."""

    def __init__(self, *args, **kwargs):
        self.device = _CPU

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _noop(*args, **kwargs):
    return None


_nvtx = types.SimpleNamespace(range_push=_noop, range_pop=_noop, mark=_noop, range=lambda *a, **k: contextlib.nullcontext())


def _cpu_get_rng_state(device=None):
    return _real_torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=None):
    _real_torch.set_rng_state(new_state)


_cuda_random = types.SimpleNamespace(
    get_rng_state=_cpu_get_rng_state,
    set_rng_state=_cpu_set_rng_state,
    manual_seed=lambda seed: _real_torch.manual_seed(seed),
)


class _CudaOnCpu(types.ModuleType):
    """``torch.cuda`` as megatron sees it on a CPU-only machine."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.current_device = lambda: _CPU
        self.set_device = _noop
        self.synchronize = _noop
        self.empty_cache = _noop
        self.current_stream = lambda device=None: _NullStream()
        self.default_stream = lambda device=None: _NullStream()
        self.Stream = _NullStream
        self.Event = _NullEvent
        self.stream = lambda stream=None: contextlib.nullcontext()
        self.set_stream = _noop
        self.nvtx = _nvtx
        self.random = _cuda_random
        self.get_rng_state = _cpu_get_rng_state
        self.set_rng_state = _cpu_set_rng_state
        self.manual_seed = _cuda_random.manual_seed
        self.manual_seed_all = _cuda_random.manual_seed
        self.default_generators = (_real_torch.default_generator,)
        self.memory_allocated = lambda *a, **k: 0
        self.memory_reserved = lambda *a, **k: 0
        self.max_memory_allocated = lambda *a, **k: 0
        self.device_count = lambda: 0

    def __getattr__(self, name):
        return getattr(_real_torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` as megatron's modules see it: see the module docstring, point 1."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        self.device = _Device
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(_real_torch, name)))

    def __getattr__(self, name):
        return getattr(_real_torch, name)


_torch_on_cpu = _TorchOnCpu()


def _remap_megatron_modules() -> int:
    """Point every loaded megatron.core module's ``torch`` global at the CPU proxy; returns how many."""
    count = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core") or module is None:
            continue
        if getattr(module, "torch", None) is _real_torch:
            module.torch = _torch_on_cpu
            count += 1
    return count


class _RemapLoader:
    """Wraps a megatron.core module's loader: the module is remapped as soon as it has executed."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if getattr(module, "torch", None) is _real_torch:
            module.torch = _torch_on_cpu

    def __getattr__(self, name):  # get_source, get_filename, ... for inspect and linecache
        return getattr(self._loader, name)


class _RemapOnImport:
    """A meta-path finder for ``megatron.core.*`` modules imported after ``apply()``.

    megatron imports many modules lazily (0.19's dist-checkpoint writer, for one), and which ones differs by
    version: remapping at import time covers them all without a per-version list of module names.
    """

    def find_spec(self, name, path, target=None):
        if not name.startswith("megatron.core."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RemapLoader(spec.loader)
                return spec
        return None


_remap_on_import = _RemapOnImport()


# --------------------------------------------------------------------------------------------------
# 2. Tensor.cuda
# --------------------------------------------------------------------------------------------------

_real_tensor_cuda = _real_torch.Tensor.cuda


def _tensor_cuda_on_cpu(self, device=None, non_blocking=False, memory_format=_real_torch.preserve_format):
    return self


# --------------------------------------------------------------------------------------------------
# 3. Narrow patches, each declaring the megatron-core versions it applies to
# --------------------------------------------------------------------------------------------------

_NARROW_PATCHES: list[tuple[Callable[[], None], tuple[str, ...]]] = []


def _applies_to(*versions: str):
    """Register a narrow patch for these megatron-core versions (each one of TESTED_MEGATRON_VERSIONS)."""
    unknown = set(versions) - set(TESTED_MEGATRON_VERSIONS)
    assert not unknown, f"a patch names untested megatron-core versions {sorted(unknown)}"

    def register(patch: Callable[[], None]) -> Callable[[], None]:
        _NARROW_PATCHES.append((patch, versions))
        return patch

    return register


def patches_for(version: str) -> list[str]:
    """Names of the narrow patches that ``apply()`` makes on megatron-core ``version``."""
    return [patch.__name__ for patch, versions in _NARROW_PATCHES if version in versions]


@_applies_to("0.16.1", "0.19.2")
def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: _real_torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: _real_torch.set_rng_state(
        new_state
    )
    import logging

    logging.getLogger(mrandom.__name__).addFilter(_DropCpuRngWarning())


class _DropCpuRngWarning:
    """On CPU the "GPU" RNG the tracker forks *is* the CPU RNG, so this warning fires on every fork."""

    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


@_applies_to("0.16.1", "0.19.2")
def _patch_torch_norm() -> None:
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__
    if getattr(original_new, "_gspo_cpu_patch", False):
        return

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        # The only obstacle to sequence parallelism is this assertion: the norm is elementwise over the
        # hidden dimension, so a sequence shard normalises exactly like the full sequence. What SP does need
        # is the gradient all-reduce over TP, which finalize_model_grads does for params tagged like this.
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = original_new(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    __new__._gspo_cpu_patch = True
    torch_norm.WrappedTorchNorm.__new__ = __new__


@_applies_to("0.16.1")  # 0.19 defines it as None itself
def _define_te_general_gemm() -> None:
    from patches import megatron_no_te  # the same mend on CUDA without TE; the model provider applies it there

    megatron_no_te.apply()


@_applies_to("0.16.1")  # 0.19 takes HAVE_TE from the TE extension, which is False without TE
def _mla_without_te() -> None:
    """0.16.1's multi_latent_attention sets ``HAVE_TE = True`` whenever megatron's TE extension module imports, which
    it does without TE (its classes then derive from a MagicMock), and calls ``isinstance(linear_proj, TELinear)``
    with that mock: take the extension's own ``HAVE_TE`` instead."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = transformer_engine.HAVE_TE


@_applies_to("0.16.1", "0.19.2")
def _patch_moe_split_sizes() -> None:
    from megatron.core.transformer.moe import moe_utils

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.to(_CPU)
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    # The dispatchers imported the name directly.
    from megatron.core.transformer.moe import token_dispatcher

    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


@_applies_to("0.16.1", "0.19.2")
def _patch_uneven_collectives() -> None:
    from megatron.core.tensor_parallel import mappings

    gather_even = mappings._gather_along_first_dim
    reduce_scatter_even = mappings._reduce_scatter_along_first_dim
    if getattr(gather_even, "_gspo_cpu_patch", False):
        return

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather_even(input_, group, output_split_sizes, use_global_buffer)
        # gloo's all_gather needs equal chunks: pad every rank's chunk to the largest, gather, trim.
        sizes = [int(s) for s in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = input_.new_empty((longest * len(sizes),) + tuple(input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(gathered, padded.contiguous(), group=group)
        chunks = gathered.split(longest, dim=0)
        return torch.cat([chunk[:size] for chunk, size in zip(chunks, sizes)], dim=0)

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter_even(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(s) for s in input_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest * len(sizes),) + tuple(input_.shape[1:]))
        for i, chunk in enumerate(input_.split(sizes, dim=0)):
            padded[i * longest : i * longest + sizes[i]] = chunk
        output = input_.new_empty((longest,) + tuple(input_.shape[1:]))
        torch.distributed.reduce_scatter_tensor(output, padded, group=group)
        return output[: sizes[group.rank()]].contiguous()

    _gather_along_first_dim._gspo_cpu_patch = True
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim


def _recompile(owner, name: str, replacements: dict[str, str]) -> None:
    """Recompile ``owner.name`` (a class or a module) from its source with textual replacements (each must occur).

    Used only for the ``param.type()`` string checks, which no remap can reach. The function keeps its
    module globals and a ``__class__`` cell, so zero-argument ``super()`` still works.
    """
    raw = inspect.getattr_static(owner, name)
    func = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    if getattr(func, "_gspo_cpu_patch", False):
        return
    source = textwrap.dedent(inspect.getsource(func))
    for old, new in replacements.items():
        if old not in source:
            raise MegatronVersionError(f"cannot patch {owner.__name__}.{name}: {old!r} not found in its source")
        source = source.replace(old, new)
    # Drop decorators (classmethod/staticmethod are re-applied below); keep the def.
    source = source[source.index("def ") :]
    wrapper = "def _make(__class__):\n" + textwrap.indent(source, "    ") + f"\n    return {name}\n"
    namespace: dict = {}
    exec(compile(wrapper, inspect.getsourcefile(func), "exec"), func.__globals__, namespace)
    new_func = namespace["_make"](owner if isinstance(owner, type) else None)
    new_func._gspo_cpu_patch = True
    if isinstance(raw, classmethod):
        new_func = classmethod(new_func)
    elif isinstance(raw, staticmethod):
        new_func = staticmethod(new_func)
    setattr(owner, name, new_func)


@_applies_to("0.16.1", "0.19.2")
def _patch_mla_rope_key_grad() -> None:
    """MLA with megatron's local spec under TP (its down projections column-parallel, then gathered): the shared
    rope key ``k_pos_emb`` is cut from the gathered down projection and used by every rank's heads, but nothing sums
    its gradient over the TP ranks, so each rank's slice of ``linear_kv_down_proj`` (and everything before it) gets
    only its own heads' share (tests/train/update/test_family_steps.py: grad norm 2.70 vs 2.83 at TP2). TE's duplicated down
    projection takes the other branch (a sequence-parallel gather, whose backward sums). Insert the missing identity
    with an all-reduce backward (megatron's ``copy_to_tensor_model_parallel_region``) on that branch."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
    from megatron.core.transformer import multi_latent_attention as mla

    mla.copy_to_tensor_model_parallel_region = copy_to_tensor_model_parallel_region
    branch = ("        if self.config.sequence_parallel:\n"  # as _recompile sees it: dedented by one level
              "            # kv_compressed:[s / TP, b, kv_lora_rank]\n")
    _recompile(mla.MLASelfAttention, "get_query_key_value_tensors",
               {branch: "        k_pos_emb = copy_to_tensor_model_parallel_region(k_pos_emb)\n" + branch})


@_applies_to("0.19.2")
def _patch_absorbed_mla_rope_key_grad() -> None:
    """The same missing sum in 0.19.2's ``AbsorbedMLASelfAttention`` (DeepSeek sparse attention's MLA, which copies
    MLA's down-projection code): its TP2 update step's grad norm was 3.01 against world 1's 3.07 (GLM-5's tiny model,
    tests/model/test_dsa.py) before the same identity with an all-reduce backward."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla

    absorbed_mla.copy_to_tensor_model_parallel_region = copy_to_tensor_model_parallel_region
    branch = ("        if self.config.sequence_parallel:\n"
              "            # kv_compressed:[s / TP, b, kv_lora_rank]\n")
    _recompile(absorbed_mla.AbsorbedMLASelfAttention, "get_query_key_value_tensors",
               {branch: "        k_pos_emb = copy_to_tensor_model_parallel_region(k_pos_emb)\n" + branch})


@_applies_to("0.16.1", "0.19.2")
def _patch_optimizer_type_checks() -> None:
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    cpu_types = {"'torch.cuda.": "'torch."}
    _recompile(DistributedOptimizer, "_build_model_and_main_param_groups", cpu_types)
    _recompile(DistributedOptimizer, "__init__", cpu_types)
    _recompile(Float16OptimizerWithFloat16Params, "__init__", cpu_types)
    _recompile(clip_grads, "clip_grad_by_total_norm_fp32", cpu_types)
    # optimizer.py imported the function by name.
    optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32


# --------------------------------------------------------------------------------------------------


def needed() -> bool:
    """The patches are for machines without a CUDA device."""
    return not _real_torch.cuda.is_available()


def apply() -> None:
    """Make megatron-core run on CPU. Idempotent; does nothing when a CUDA device is present.

    Call it before building models or optimizers; megatron-core modules imported later are remapped as they
    load.
    """
    global _applied
    if not needed():
        return
    version = _check_version()
    if not _applied:
        sys.meta_path.insert(0, _remap_on_import)
        _real_torch.Tensor.cuda = _tensor_cuda_on_cpu
        for patch, versions in _NARROW_PATCHES:
            if version in versions:
                patch()
        _applied = True
    _remap_megatron_modules()
