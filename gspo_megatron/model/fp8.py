"""Block-scaled FP8 checkpoints (DeepSeek-V3/R1, Kimi-K2): dequantized tensor by tensor as they are read.

Such a checkpoint stores its 2-D linear weights as ``float8_e4m3fn`` with a ``{name}_scale_inv`` tensor of one fp32
scale per ``weight_block_size`` block (``quantization_config``: ``quant_method: fp8``, ``weight_block_size: [128,
128]``; edge blocks are partial); embeddings, norms, the router and ``lm_head`` stay bf16 / fp32. The weight is
``fp8.float() * scale_inv`` broadcast over each block (DeepSeek's ``weight_dequant``), here cast to the checkpoint's
``torch_dtype`` (bf16). ``BlockFp8Source`` does that on every read of a quantized tensor, one tensor at a time (a
rank reads only the tensors it loads; nothing holds the whole model in a wider dtype), and hides the scales: the
bridge, the converter, the policy build, ``score`` and the pre-flight checks (all through ``hf_files.open_hf_dir``) see
an ordinary bf16 checkpoint; what loads a directory by itself gets ``hf_files.plain_copy``. Exports are bf16 (FP8
export for FP8 rollouts is not done): ``dequantized_config`` is the config.json that goes with them.
"""

from __future__ import annotations

import torch

from .errors import UnsupportedModel
from .tensor_source import TensorSource

SCALE_SUFFIX = "_scale_inv"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def block_size(config: dict) -> tuple[int, int] | None:
    """The (rows, cols) scale block of an FP8 block-scaled checkpoint, None for an unquantized one."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3" or not quant.get("weight_block_size"):
        raise UnsupportedModel(f"quantization_config={quant} is not supported: only block-scaled FP8 (quant_method "
                               "fp8, fmt e4m3, weight_block_size) is dequantized on load")
    rows, cols = quant["weight_block_size"]
    return int(rows), int(cols)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[R, C] float8 weight and [ceil(R/br), ceil(C/bc)] scales -> the [R, C] fp32 weight."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def dequantized_config(config: dict) -> dict:
    """config.json for the dequantized weights: no quantization_config, the dtype they are in."""
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    out["torch_dtype" if "torch_dtype" in out else "dtype"] = str(_dtype(config)).removeprefix("torch.")
    return out


def _dtype(config: dict) -> torch.dtype:
    return _DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")), torch.bfloat16)


class BlockFp8Source(TensorSource):
    """``source`` with every float8 tensor dequantized on read (its scale consumed, not listed)."""

    def __init__(self, source: TensorSource, config: dict):
        self.source, self.block, self.dtype = source, block_size(config), _dtype(config)
        dtypes = source.dtypes()
        self.quantized = {n for n, d in dtypes.items() if d == torch.float8_e4m3fn}
        missing = sorted(n for n in self.quantized if n + SCALE_SUFFIX not in dtypes)
        if missing:
            raise UnsupportedModel(f"float8 tensors without a {SCALE_SUFFIX} block scale: {', '.join(missing[:8])}")
        self._scales = {n + SCALE_SUFFIX for n in self.quantized}

    def shapes(self):
        return {n: s for n, s in self.source.shapes().items() if n not in self._scales}

    def dtypes(self):
        return {n: self.dtype if n in self.quantized else d for n, d in self.source.dtypes().items()
                if n not in self._scales}

    def read(self, name, index=None):
        if name not in self.quantized:
            return self.source.read(name, index)
        weight = dequantize(self.source.read(name), self.source.read(name + SCALE_SUFFIX), self.block)
        weight = weight.to(self.dtype)
        return weight if index is None else weight[index].contiguous()

    def total_bytes(self) -> int:
        return self.source.total_bytes()
