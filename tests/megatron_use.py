"""Whether a test built a Megatron model, in its own process or in its ranks: what decides that it runs again on
megatron-core 0.19 (the ``megatron`` marker; tests/conftest.py fails an unmarked test that does).

A Megatron model is any ``torch.nn.Module`` whose class is megatron-core's: every model, layer spec, optimizer and
dist checkpoint of ours starts from one. Building process groups alone does not count (it needs no model).
"""

from __future__ import annotations

import torch

_real_init = torch.nn.Module.__init__


class MegatronUse:
    """``start()`` from now on records the megatron-core module classes constructed; ``stop()`` returns them."""

    def __init__(self):
        self.built: set[str] = set()

    def _install(self) -> None:
        if torch.nn.Module.__init__ is not _real_init:
            return
        built = self.built

        def init(module, *args, **kwargs):
            cls = type(module)
            if cls.__module__.startswith("megatron."):
                built.add(f"{cls.__module__}.{cls.__qualname__}")
            _real_init(module, *args, **kwargs)

        torch.nn.Module.__init__ = init

    def start(self) -> None:
        self._install()
        self.built.clear()

    def stop(self) -> list[str]:
        return sorted(self.built)


probe = MegatronUse()
