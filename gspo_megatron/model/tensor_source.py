"""What every reader of named tensors offers (``hf_files``' safetensors directories and dicts, ``fp8``'s dequantizing
view): names, shapes and dtypes known before reading, and reads that take an index (a rank's shard)."""

from __future__ import annotations

import torch


class TensorSource:
    """Named tensors with shapes and dtypes known before reading."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def dtypes(self) -> dict[str, torch.dtype]:
        raise NotImplementedError

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        raise NotImplementedError
