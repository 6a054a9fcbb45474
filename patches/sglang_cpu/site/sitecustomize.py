"""Runs at start-up in every process of a CPU SGLang server (this folder leads its PYTHONPATH, see
patches/sglang_cpu): installs ``_gspo_batched_decode`` into the ``torch_native`` attention backend when sglang
imports it. Nothing is imported eagerly; for any sglang but 0.5.23 nothing is patched."""

import importlib.abc
import importlib.util
import sys

_TARGET = "sglang.srt.layers.attention.torch_native_backend"


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
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
                import _gspo_batched_decode

                _gspo_batched_decode.install(module.TorchNativeAttnBackend)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
