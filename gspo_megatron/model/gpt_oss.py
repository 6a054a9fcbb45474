"""gpt-oss: its config fields, its fused expert tensors, and its MXFP4 checkpoints dequantized on read.

Config: a learnt sink logit per head joins every attention softmax (megatron's ``softmax_type="learnable"``, the
``core_attention.softmax_offset`` parameter); ``layer_types`` alternate sliding-window (the last ``sliding_window``
keys, the query's own included: megatron's ``window_size=(sliding_window - 1, 0)``) and full attention; every
linear has a bias (``attention_bias``: megatron's all-or-nothing ``add_bias_linear``, router included); the experts'
GLU is ``(clamp(up, -l, l) + 1) * g * sigmoid(1.702 g)`` with ``g = clamp(gate, max=l)``, ``l = swiglu_limit``
(megatron's ``quick_gelu`` with ``activation_func_clamp_value`` and ``glu_linear_offset=1``); YaRN RoPE with
``truncate: false`` (megatron's ``yarn_correction_range_round_to_int=False``).

Tensors: transformers stores each layer's experts stacked and transposed: ``gate_up_proj`` [E, hidden, 2 * ffn]
with gate and up interleaved along the last dim (gate in the even columns), ``gate_up_proj_bias`` [E, 2 * ffn]
(interleaved the same way), ``down_proj`` [E, ffn, hidden], ``down_proj_bias`` [E, hidden]. ``ExpertsView`` shows
the bridge each expert's tensors as a Megatron linear holds them (``experts.{e}.gate_proj.weight`` [ffn, hidden] and
so on: ``EXPERT_PARTS``), so the family's mapping rows are the ordinary per-expert ones; ``fuse_experts`` turns the
bridge's per-expert export back into the stacked tensors, once a layer's experts have all passed (bit for bit:
only transposes and interleaving). Megatron-Bridge's #3743 (``down_proj`` exported untransposed) is what the
round-trip test guards against.

MXFP4 (the released checkpoints): each stacked expert weight ``W`` is ``W_blocks`` [E, rows, cols / 32, 16] uint8
(two e2m1 values a byte, low nibble first) with ``W_scales`` [E, rows, cols / 32] uint8 (a power-of-two exponent +
127 per 32 values), rows x cols being the transposed [E, 2 * ffn, hidden] / [E, hidden, ffn] layout.
``Mxfp4Source`` dequantizes on read to the checkpoint's dtype in transformers' layout (``convert_moe_packed_tensors``
does the same), hiding the blocks and scales. Exports are bf16 (no MXFP4 export).
"""

from __future__ import annotations

import re

import torch

from .errors import UnsupportedModel
from .tensor_source import TensorSource

# megatron's quick_gelu is x * sigmoid(1.702 x): the one swiglu_alpha it computes.
QUICK_GELU_ALPHA = 1.702
_LAYER_TYPES = {"sliding_attention": True, "full_attention": False}


def gpt_oss_fields(config: dict, num_layers: int) -> dict:
    """ModelSpec's gpt-oss fields from config.json, or ``UnsupportedModel`` naming the field."""
    alpha = float(config.get("swiglu_alpha", QUICK_GELU_ALPHA))
    if alpha != QUICK_GELU_ALPHA:
        raise UnsupportedModel(f"swiglu_alpha={alpha} in config.json is not supported for gpt_oss (only "
                               f"{QUICK_GELU_ALPHA}: megatron-core's quick_gelu fixes it)")
    if not config.get("attention_bias", True):
        raise UnsupportedModel("attention_bias=false in config.json is not supported for gpt_oss: its experts and "
                               "router always have biases, and megatron-core's add_bias_linear is one switch for all")
    layer_types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                                for i in range(num_layers)]
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown or len(layer_types) != num_layers:
        raise UnsupportedModel(f"layer_types={layer_types} in config.json: gpt_oss takes one of "
                               f"{sorted(_LAYER_TYPES)} per layer ({num_layers} layers)")
    sliding = tuple(_LAYER_TYPES[t] for t in layer_types)
    window = int(config.get("sliding_window") or 0)
    if any(sliding) and window < 1:
        raise UnsupportedModel(f"sliding_window={config.get('sliding_window')} with sliding_attention layers")
    return dict(attention_sinks=True, sliding_window=window if any(sliding) else 0, sliding_layers=sliding,
                linear_bias=True, glu_clamp=float(config.get("swiglu_limit", 7.0)))


def megatron_fields(spec) -> dict:
    """``TransformerConfig`` fields for a gpt-oss ``ModelSpec`` (sinks, windows, biases, the clamped GLU)."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    fields = dict(softmax_type="learnable", add_bias_linear=True, activation_func=quick_gelu,
                  activation_func_clamp_value=spec.glu_clamp, glu_linear_offset=1.0, bias_activation_fusion=False)
    if any(spec.sliding_layers):
        # megatron's window: (keys before the query, keys after it); the list marks windowed layers (1 = windowed)
        fields.update(window_size=(spec.sliding_window - 1, 0),
                      window_attn_skip_freq=[int(s) for s in spec.sliding_layers])
    return fields


def fix_megatron_parameters(model) -> None:
    """Three megatron-core bugs of gpt-oss's parameters (0.16.1 and 0.19.2), fixed on the built model.

    The sinks (``core_attention.softmax_offset``) are split over TP with the heads, but not tagged
    ``tensor_model_parallel``: the gradient norm counted them as TP duplicates, on TP rank 0 only (a TP2 step's norm
    was 0.1% below world 1's). They are tagged (dist checkpoints already shard them by head). And biased experts
    (``SequentialMLP``), on each local expert:

    - its MLP adds the ``linear_fc2`` bias in place (``output += bias * prob``, mlp.py) to what ``linear_fc2``
      returns, which under expert-TP 1 is the identity reduce's input returned as is: autograd refuses that in-place
      add on the view ("Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace"), so a
      backward fails (inference does not see it). ``linear_fc2`` returns a copy instead.
    - ``RowParallelLinear`` tags its bias ``sequence_parallel`` under sequence parallelism, so ``finalize_model_grads``
      sums the expert bias's gradient over the TP ranks on top of the expert-data-parallel reduction that already
      covers them: a TP2 step's gradient of it was twice world 1's. The tag is removed (expert weights carry none).
      And it is not tagged ``tensor_model_parallel`` (the weight is): under TP2 x EP2 the gradient norm skipped the
      biases of TP rank 1's experts as duplicates of rank 0's (0.1% below world 1's). It is tagged."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.transformer.moe.experts import SequentialMLP

    def copying(forward):
        def wrapper(*args, **kwargs):
            output, bias = forward(*args, **kwargs)
            return output.clone(), bias

        return wrapper

    for module in model.modules():
        if isinstance(getattr(module, "softmax_offset", None), torch.nn.Parameter):
            set_tensor_model_parallel_attributes(module.softmax_offset, True, 0, 1)
        if isinstance(module, SequentialMLP):
            for expert in module.local_experts:
                expert.linear_fc2.forward = copying(expert.linear_fc2.forward)
                if expert.linear_fc2.bias is not None:
                    expert.linear_fc2.bias.sequence_parallel = False
                    # each EP rank's experts are its own: not a TP duplicate the norm may skip on TP rank > 0
                    set_tensor_model_parallel_attributes(expert.linear_fc2.bias, True, 0, 1)


# ---- stacked experts <-> per-expert tensors ----------------------------------------------------------------------

_STACKED = re.compile(r"^(?P<prefix>.*model\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<name>gate_up_proj|"
                      r"gate_up_proj_bias|down_proj|down_proj_bias)$")
_PER_EXPERT = re.compile(r"^(?P<prefix>.*model\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<expert>\d+)\."
                         r"(?P<name>(?:gate|up|down)_proj\.(?:weight|bias))$")
# per-expert name -> (stacked name, how expert e's tensor comes out of the stacked one)
EXPERT_PARTS = {
    "gate_proj.weight": ("gate_up_proj", lambda t: t[:, 0::2].t()),
    "up_proj.weight": ("gate_up_proj", lambda t: t[:, 1::2].t()),
    "gate_proj.bias": ("gate_up_proj_bias", lambda t: t[0::2]),
    "up_proj.bias": ("gate_up_proj_bias", lambda t: t[1::2]),
    "down_proj.weight": ("down_proj", lambda t: t.t()),
    "down_proj.bias": ("down_proj_bias", lambda t: t),
}
_PARTS_OF = {stacked: [p for p, (s, _) in EXPERT_PARTS.items() if s == stacked]
             for stacked in {s for s, _ in EXPERT_PARTS.values()}}


def _split_shape(stacked: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Each per-expert part's shape from a stacked tensor's [E, ...] shape."""
    probe = torch.empty(shape[1:], device="meta")
    return {part: tuple(EXPERT_PARTS[part][1](probe).shape) for part in _PARTS_OF[stacked]}


def per_expert_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``shapes`` with each stacked expert tensor replaced by its experts' tensors (the names the mapping uses)."""
    out = {}
    for name, shape in shapes.items():
        match = _STACKED.match(name)
        if not match:
            out[name] = shape
            continue
        for part, part_shape in _split_shape(match["name"], shape).items():
            for expert in range(shape[0]):
                out[f"{match['prefix']}.{expert}.{part}"] = part_shape
    return out


def stacked_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The inverse of ``per_expert_shapes``: the checkpoint's tensors from the mapping's per-expert ones."""
    out, experts = {}, {}
    for name, shape in shapes.items():
        match = _PER_EXPERT.match(name)
        if not match:
            out[name] = shape
            continue
        stacked, _ = EXPERT_PARTS[match["name"]]
        key = f"{match['prefix']}.{stacked}"
        experts.setdefault(key, set()).add(int(match["expert"]))
        if match["name"] in ("gate_proj.weight", "down_proj.weight"):
            rows, cols = shape  # [ffn, hidden] or [hidden, ffn]: stacked transposed, gate and up side by side
            out[key] = (cols, rows * 2) if stacked == "gate_up_proj" else (cols, rows)
        elif match["name"] in ("gate_proj.bias", "down_proj.bias"):
            out[key] = (shape[0] * 2,) if stacked == "gate_up_proj_bias" else shape
    return {name: (len(experts[name]), *shape) if name in experts else shape for name, shape in out.items()}


def stacked_name(name: str) -> str:
    """The checkpoint tensor a per-expert name is part of (other names unchanged)."""
    match = _PER_EXPERT.match(name)
    return f"{match['prefix']}.{EXPERT_PARTS[match['name']][0]}" if match else name


class ExpertsView(TensorSource):
    """``source`` with gpt-oss's stacked expert tensors shown per expert (``EXPERT_PARTS``)."""

    def __init__(self, source: TensorSource):
        self.source = source
        self._shapes = per_expert_shapes(source.shapes())
        dtypes = source.dtypes()
        self._dtypes = {name: dtypes[stacked_name(name)] for name in self._shapes}

    def shapes(self):
        return self._shapes

    def dtypes(self):
        return self._dtypes

    def read(self, name, index=None):
        match = _PER_EXPERT.match(name)
        if not match:
            return self.source.read(name, index)
        stacked, take = EXPERT_PARTS[match["name"]]
        expert = int(match["expert"])
        full = self.source.read(f"{match['prefix']}.{stacked}", (slice(expert, expert + 1),))[0]
        tensor = take(full)
        return (tensor if index is None else tensor[index]).contiguous()

    def total_bytes(self) -> int:
        return self.source.total_bytes()


def fuse_experts(stream, num_experts: int):
    """The bridge's export (``(hf_name, tensor)``, per-expert gpt-oss names) with each layer's expert tensors
    stacked back into the checkpoint's tensors, each yielded once all its experts' parts have passed."""
    pending: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in stream:
        match = _PER_EXPERT.match(name)
        if not match:
            yield name, tensor
            continue
        stacked = EXPERT_PARTS[match["name"]][0]
        key = f"{match['prefix']}.{stacked}"
        parts = pending.setdefault(key, {p: {} for p in _PARTS_OF[stacked]})
        parts[match["name"]][int(match["expert"])] = tensor.detach().clone()
        if all(len(experts) == num_experts for experts in parts.values()):
            del pending[key]
            yield key, _stack(stacked, parts, num_experts)
    if pending:
        raise RuntimeError(f"gpt-oss experts export ended with {sorted(pending)} incomplete")


def _stack(stacked: str, parts: dict[str, dict[int, torch.Tensor]], num_experts: int) -> torch.Tensor:
    def each(part):
        return [parts[part][e] for e in range(num_experts)]

    if stacked in ("gate_up_proj", "gate_up_proj_bias"):
        gate, up = (torch.stack(each(p)) for p in (("gate_proj.weight", "up_proj.weight") if stacked == "gate_up_proj"
                                                    else ("gate_proj.bias", "up_proj.bias")))
        if stacked == "gate_up_proj":
            gate, up = gate.transpose(1, 2), up.transpose(1, 2)  # [E, hidden, ffn]
        return torch.stack([gate, up], dim=-1).flatten(-2).contiguous()  # interleaved: gate even, up odd
    if stacked == "down_proj":
        return torch.stack(each("down_proj.weight")).transpose(1, 2).contiguous()
    return torch.stack(each("down_proj.bias")).contiguous()


# ---- MXFP4 --------------------------------------------------------------------------------------------------------

BLOCKS, SCALES = "_blocks", "_scales"
# e2m1: sign, 2 exponent bits, 1 mantissa bit; the nibble's value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def is_mxfp4(config: dict) -> bool:
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, rows, G, 16] uint8 blocks and [E, rows, G] uint8 exponents -> the [E, G * 32, rows] weight in ``dtype``
    (transposed back to transformers' layout)."""
    if blocks.shape[:-1] != scales.shape:
        raise UnsupportedModel(f"MXFP4 blocks of shape {list(blocks.shape)} with scales {list(scales.shape)}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    weight = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return weight.flatten(-2).transpose(1, 2).to(dtype).contiguous()


class Mxfp4Source(TensorSource):
    """``source`` with every ``W_blocks`` / ``W_scales`` pair read as the dequantized ``W``."""

    def __init__(self, source: TensorSource, config: dict):
        self.source = source
        self.dtype = _DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")), torch.bfloat16)
        shapes = source.shapes()
        self.quantized = {n.removesuffix(BLOCKS) for n in shapes if n.endswith(BLOCKS)}
        missing = sorted(n + SCALES for n in self.quantized if n + SCALES not in shapes)
        if missing:
            raise UnsupportedModel(f"MXFP4 blocks without their scales: {', '.join(missing[:8])}")
        self._hidden = {n + suffix for n in self.quantized for suffix in (BLOCKS, SCALES)}
        self._shapes = {n: s for n, s in shapes.items() if n not in self._hidden}
        for name in self.quantized:
            experts, rows, groups, pair = shapes[name + BLOCKS]
            self._shapes[name] = (experts, groups * pair * 2, rows)

    def shapes(self):
        return self._shapes

    def dtypes(self):
        dtypes = self.source.dtypes()
        return {n: self.dtype if n in self.quantized else dtypes[n] for n in self._shapes}

    def read(self, name, index=None):
        if name not in self.quantized:
            return self.source.read(name, index)
        # expert-sliced reads (ExpertsView) read only that expert's blocks
        first = index[0] if index else slice(None)
        weight = dequantize_mxfp4(self.source.read(name + BLOCKS, (first,)), self.source.read(name + SCALES, (first,)),
                                  self.dtype)
        return weight if index is None else weight[(slice(None),) + tuple(index[1:])].contiguous()

    def total_bytes(self) -> int:
        return self.source.total_bytes()


def dequantized_config(config: dict) -> dict:
    """config.json for the dequantized weights (they are in the config's dtype already)."""
    return {k: v for k, v in config.items() if k != "quantization_config"}
