"""Block-scaled FP8 weights (DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8): quantized for FP8 rollouts and exports,
dequantized tensor by tensor as FP8 checkpoints are read.

Such a checkpoint stores its 2-D linear weights as ``float8_e4m3fn`` with a ``{name}_scale_inv`` tensor of one fp32
scale per ``weight_block_size`` block (``quantization_config``: ``quant_method: fp8``, ``weight_block_size: [128,
128]``; edge blocks are partial); embeddings, norms, the router and ``lm_head`` stay bf16 / fp32. The weight is
``fp8.float() * scale_inv`` broadcast over each block (DeepSeek's ``weight_dequant``), here cast to the checkpoint's
``torch_dtype`` (bf16). ``BlockFp8Source`` does that on every read of a quantized tensor, one tensor at a time (a
rank reads only the tensors it loads; nothing holds the whole model in a wider dtype), and hides the scales: the
bridge, the converter, the policy build, ``score`` and the pre-flight checks (all through ``hf_files.open_hf_dir``) see
an ordinary bf16 checkpoint; what loads a directory by itself gets ``hf_files.plain_copy``. ``dequantized_config``
is the config.json of such weights exported in bf16.

The other way (``quantize``, for FP8 rollouts and ``convert_megatron_to_hf.py --fp8``): per block, scale_inv =
max(|block|) / 448 in fp32 (448: float8_e4m3fn's largest finite value) and fp8 = (w / scale_inv) rounded to the
nearest float8_e4m3fn, the layout DeepSeek-V3's and Qwen3's FP8 checkpoints use and SGLang's ``Fp8LinearMethod``
loads. ``quantize_reference`` is the torch definition; on CUDA a Triton kernel (``_quantize_kernel``, one program per
block) computes the same bits (tests/model/test_fp8_quantize.py, under ``TRITON_INTERPRET=1``). ``Fp8Scheme`` says
which tensors are quantized: the decoder layers' 2-D linear weights; embeddings, ``lm_head``, norms, routers and
their bias stay in high precision (the peers' defaults), and optionally the first and last ``keep_layers`` layers.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from .errors import UnsupportedModel
from .tensor_source import TensorSource

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
DEFAULT_BLOCK = (128, 128)
# A block of zeros: any positive scale reproduces it; this one keeps w / scale_inv finite.
MIN_ABSMAX = 1e-12
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def block_size(config: dict) -> tuple[int, int] | None:
    """The (rows, cols) scale block of an FP8 block-scaled checkpoint, None for an unquantized one."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    # fmt: DeepSeek's releases say e4m3, MiniMax-M2's float8_e4m3fn (the same format)
    if (quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn")
            or not quant.get("weight_block_size")):
        raise UnsupportedModel(f"quantization_config={quant} is not supported: only block-scaled FP8 (quant_method "
                               "fp8, fmt e4m3, weight_block_size) is dequantized on load")
    rows, cols = quant["weight_block_size"]
    return int(rows), int(cols)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[R, C] float8 weight and [ceil(R/br), ceil(C/bc)] scales -> the [R, C] fp32 weight."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def quantize(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] weight -> ([R, C] float8_e4m3fn, [ceil(R/br), ceil(C/bc)] fp32 ``weight_scale_inv``), edge blocks
    partial. The Triton kernel on CUDA, ``quantize_reference`` elsewhere: the same bits."""
    if weight.dim() != 2:
        raise ValueError(f"quantize takes a 2-D weight, got shape {tuple(weight.shape)}")
    if weight.is_cuda:
        return quantize_triton(weight, block)
    return quantize_reference(weight, block)


def quantize_reference(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition in torch: the weight zero-padded to whole blocks (zeros change no block's max), viewed as
    [R/br, br, C/bc, bc]; per block scale_inv = max(|w|, MIN_ABSMAX) / 448 and fp8 = clamp(w / scale_inv, +-448)
    rounded to nearest even, all in fp32."""
    rows, cols = weight.shape
    br, bc = block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    padded = torch.nn.functional.pad(weight.float(), (0, nc * bc - cols, 0, nr * br - rows))
    blocks = padded.view(nr, br, nc, bc)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp_min(MIN_ABSMAX) / FP8_MAX
    quantized = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(nr * br, nc * bc)[:rows, :cols].contiguous(), scale_inv


def quantize_triton(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_reference`` as one Triton program per block (CUDA tensors; CPU ones under ``TRITON_INTERPRET=1``).
    IEEE divisions (``div_rn``: Triton's ``/`` is an approximate one on GPUs) and a round to nearest even done in fp32
    before the (then exact) cast give the reference's bits."""
    import triton

    rows, cols = weight.shape
    br, bc = block
    weight = weight.contiguous()
    quantized = torch.empty(rows, cols, dtype=FP8_DTYPE, device=weight.device)
    scale_inv = torch.empty(math.ceil(rows / br), math.ceil(cols / bc), dtype=torch.float32, device=weight.device)
    _quantize_kernel()[scale_inv.shape](
        weight, quantized, scale_inv, rows, cols, br, bc, MIN_ABSMAX, FP8_MAX,
        TILE_R=triton.next_power_of_2(br), TILE_C=triton.next_power_of_2(bc))
    return quantized, scale_inv


@functools.cache
def _quantize_kernel():
    """The Triton kernel, defined on first use: importing triton costs seconds, and ``TRITON_INTERPRET`` is read
    when a kernel is defined (tests set it first)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(w_ptr, q_ptr, s_ptr, R, C, BR, BC, min_absmax, fp8_max, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
        bi, bj = tl.program_id(0), tl.program_id(1)
        r = bi * BR + tl.arange(0, TILE_R)
        c = bj * BC + tl.arange(0, TILE_C)
        ok = ((r < R) & (r < (bi + 1) * BR))[:, None] & ((c < C) & (c < (bj + 1) * BC))[None, :]
        offsets = r.to(tl.int64)[:, None] * C + c[None, :]
        w = tl.load(w_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        absmax = tl.maximum(tl.max(tl.max(tl.abs(w), axis=1), axis=0), min_absmax)
        scale_inv = tl.math.div_rn(absmax, fp8_max)
        x = tl.clamp(tl.math.div_rn(w, scale_inv), -fp8_max, fp8_max)
        # Rounded to float8_e4m3fn's grid here, to nearest even, so that the cast below is exact: Triton's
        # interpreter rounds its fp32 -> fp8 casts wrongly (no carry into the exponent, subnormals truncated). The
        # grid's step is 2^(e - 3) for |x| in [2^e, 2^(e+1)), e >= -6, and 2^-9 below (subnormals); x / step is
        # then below 16, and adding and subtracting 1.5 * 2^23 rounds it to an integer, ties to even.
        e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(e, -6) - 3
        step = ((e + 127) << 23).to(tl.float32, bitcast=True)
        inv_step = ((127 - e) << 23).to(tl.float32, bitcast=True)
        rounded = ((tl.abs(x) * inv_step + 12582912.0) - 12582912.0) * step
        x = tl.where(x < 0, -rounded, rounded)  # the sign kept: what rounds to zero is -0.0 if negative, as in torch
        tl.store(q_ptr + offsets, x.to(tl.float8e4nv), mask=ok)
        tl.store(s_ptr + bi * tl.num_programs(1) + bj, scale_inv)

    return kernel


# A decoder layer's weight: model.layers.<i>.<module>.weight, or model.language_model.layers.<i>.<module>.weight in a
# vision-language checkpoint (Qwen3.5's)
_LAYER_WEIGHT = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.+)\.weight$")
# Modules of a decoder layer kept in high precision: the routers (their bias is 1-D, kept anyway), and the gated
# DeltaNet's beta and decay projections (Qwen3.5's in_proj_b / in_proj_a, Qwen3-Next's in_proj_ba, as NeMo-RL
# keeps them): one row per value head, which SGLang fuses into a projection of two parts far below a 128-row block.
# SGLang matches these on dotted boundaries (``mlp.gate`` is not ``mlp.gate_up_proj``).
KEPT_MODULES = ("mlp.gate", "mlp.shared_expert_gate", "block_sparse_moe.gate", "linear_attn.in_proj_b",
                "linear_attn.in_proj_a", "linear_attn.in_proj_ba")
# Outside the decoder layers nothing is quantized; these are named in quantization_config so that SGLang builds them
# unquantized too: the embeddings, lm_head, a vision tower (Qwen3.5's) and MTP layers stored apart (Qwen3.5's mtp.*)
KEPT_OUTSIDE_LAYERS = ("lm_head", "model.embed_tokens", "model.visual", "mtp")


@dataclass(frozen=True)
class Fp8Scheme:
    """Which Hugging Face tensors of a model of ``num_layers`` decoder layers become block-FP8, and how: every 2-D
    ``model.layers.<i>.*.weight`` of a decoder layer but the routers (``KEPT_MODULES``) and the first and last
    ``keep_layers`` layers, in ``block`` blocks. Embeddings, ``lm_head``, norms, biases and MTP layers (indices from
    ``num_layers`` on) stay as they are."""

    num_layers: int
    block: tuple[int, int] = DEFAULT_BLOCK
    keep_layers: int = 0

    def __post_init__(self):
        if len(self.block) != 2 or min(self.block) < 1:
            raise ValueError(f"fp8 block={self.block} must be two positive sizes, e.g. (128, 128)")
        if self.keep_layers < 0:
            raise ValueError(f"fp8 keep_layers={self.keep_layers} must be >= 0")
        object.__setattr__(self, "block", tuple(int(b) for b in self.block))

    @property
    def kept_layers(self) -> list[int]:
        k = min(self.keep_layers, self.num_layers)
        return sorted(set(range(k)) | set(range(self.num_layers - k, self.num_layers)))

    def quantizes(self, name: str, shape) -> bool:
        match = _LAYER_WEIGHT.match(name)
        if match is None or len(shape) != 2:
            return False
        layer, module = int(match[1]), match[2]
        if layer >= self.num_layers or layer in self.kept_layers:
            return False
        return not any(module == m or module.endswith("." + m) for m in KEPT_MODULES)

    def quantization_config(self, mtp_layers: int = 0) -> dict:
        """config.json's ``quantization_config`` of weights quantized so: what SGLang's ``Fp8Config`` and
        transformers read (``modules_to_not_convert``: module paths built unquantized; ``mtp_layers`` MTP layers
        after the last decoder layer, carried unquantized, among them)."""
        layers = [*self.kept_layers, *range(self.num_layers, self.num_layers + mtp_layers)]
        kept = [*KEPT_OUTSIDE_LAYERS, *KEPT_MODULES, *(f"model.layers.{i}" for i in layers)]
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block), "modules_to_not_convert": kept}

    def config(self, config: dict) -> dict:
        """The model's config.json for weights quantized so: with this ``quantization_config``."""
        mtp = int(config.get("num_nextn_predict_layers") or 0)
        return {**config, "quantization_config": self.quantization_config(mtp)}

    def unservable_size(self, text_config: dict, tp_size: int = 1) -> str | None:
        """Why SGLang would refuse this model's FP8 layers at start-up, in a sentence naming the config field, or
        None. Its block-FP8 layers hold whole scale blocks per shard: each part of a merged projection (q, k and v;
        gate and up, in the dense MLP, the experts and the shared expert) must be a multiple of the block's rows on
        each of the server's ``tp_size`` ranks (``Fp8LinearMethod.validate_block_quant_shapes``,
        ``Fp8MoEMethod.create_weights``)."""
        if len(self.kept_layers) == self.num_layers:
            return None  # nothing quantized
        parts = {}
        if text_config.get("linear_num_value_heads"):  # the gated DeltaNet's in_proj_qkvz: q, k, v and z parts
            parts["linear_num_key_heads x linear_key_head_dim"] = \
                text_config["linear_num_key_heads"] * text_config["linear_key_head_dim"]
            parts["linear_num_value_heads x linear_value_head_dim"] = \
                text_config["linear_num_value_heads"] * text_config["linear_value_head_dim"]
        if not text_config.get("kv_lora_rank"):  # MLA's projections are not merged q, k, v parts
            heads = text_config["num_attention_heads"]
            head_dim = text_config.get("head_dim") or text_config["hidden_size"] // heads
            parts["num_attention_heads x head_dim"] = heads * head_dim
            parts["num_key_value_heads x head_dim"] = text_config.get("num_key_value_heads", heads) * head_dim
        parts.update({field: text_config.get(field) for field in
                      ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")})
        rows = self.block[0]
        for field, size in parts.items():
            if size and size % (rows * tp_size):
                smaller_tp = " or a smaller rollout.server_args.tp_size" if size % rows == 0 else ""
                return (f"{field} = {size}, not a multiple of the FP8 block's {rows} rows on each of {tp_size} "
                        f"server TP rank(s): SGLang's block-FP8 layers refuse a projection part that is not whole "
                        f"blocks per rank; set rollout.fp8=false{smaller_tp}")
        return None


def quantized_stream(named_tensors: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Scheme
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_tensors`` with each weight ``scheme`` quantizes replaced by its ``{name}_scale_inv`` (fp32) and then
    the float8_e4m3fn weight, as it streams: one tensor's quantization alive at a time. The scale comes first so
    that the fp8 bytes (1-byte aligned) follow the 4-byte scales in a packed bucket without padding."""
    for name, tensor in named_tensors:
        if scheme.quantizes(name, tuple(tensor.shape)):
            weight, scale_inv = quantize(tensor.detach(), scheme.block)
            yield name + SCALE_SUFFIX, scale_inv
            yield name, weight
        else:
            yield name, tensor


def quantized_dir_config(config: dict, scheme: Fp8Scheme) -> dict:
    """config.json of a directory whose weights ``scheme`` quantized (``hf_files.quantized_copy``), from the
    dequantized ``config`` (a quantized source's own quantization dropped: ``hf_files.dequantized_config``): the
    fields SGLang reads added (``hf_config.serving_config``), then ``scheme``'s ``quantization_config``."""
    from .hf_config import serving_config

    return scheme.config(serving_config(config))


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
