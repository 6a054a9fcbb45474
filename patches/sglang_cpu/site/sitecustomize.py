"""Runs at start-up in every process of a CPU SGLang server (this folder leads its PYTHONPATH, see
patches/sglang_cpu): patches three sglang modules when sglang imports them. Nothing is imported eagerly; for any
sglang but 0.5.23 nothing is patched.

- ``torch_native_backend``: ``_gspo_batched_decode`` batches the decode attention.
- ``pool_host.common``: host buffers on a CPU device are plain memory (``_gspo_cpu_host_alloc``): the default
  allocator pins and cudaHostRegisters them, which fails without CUDA. The routed-experts capture
  (``--enable-return-routed-experts``, rollout routing replay) allocates its host cache this way.
- ``entrypoints.engine``: the scheduler and detokenizer processes are forked, not spawned (``_gspo_fork_children``):
  a spawned child imports sglang, torch and transformers again, two thirds of a CPU server's start.
"""

import importlib.abc
import importlib.util
import sys


def _batched_decode(module):
    import _gspo_batched_decode

    _gspo_batched_decode.install(module.TorchNativeAttnBackend)


def _cpu_host_alloc(module):
    import _gspo_cpu_host_alloc

    _gspo_cpu_host_alloc.install(module)


def _fork_children(module):
    import _gspo_fork_children

    _gspo_fork_children.install(module)


_TARGETS = {
    "sglang.srt.entrypoints.engine": _fork_children,
    "sglang.srt.layers.attention.torch_native_backend": _batched_decode,
    "sglang.srt.mem_cache.pool_host.common": _cpu_host_alloc,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        patch = _TARGETS.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            from importlib.metadata import version

            if version("sglang") == "0.5.23":
                patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
