"""The block-FP8 quantizer (``model.fp8.quantize``): the torch reference against the definition written out block by
block, its round trip through the loader's dequantizer, and the Triton kernel against the reference bit for bit, run
by Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1`` set here before the kernel is first defined; the
kernel is defined on first use, and only this file uses it).

Every comparison is exact (``float8_e4m3fn`` bytes and fp32 scales equal bit for bit). Shapes cover partial edge
blocks in both dimensions, a block size that is not a power of two (the kernel's tile is then larger than its
block), a block of zeros, bf16 / fp16 / fp32 inputs and values spanning float8_e4m3fn's subnormals.
"""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from gspo_megatron.model import fp8  # noqa: E402

CASES = [((37, 50), (16, 12)), ((130, 257), (128, 128)), ((8, 8), (128, 128)), ((64, 96), (32, 32))]


def _weight(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-6, 1, shape[1])  # columns from tiny to large
    w[: min(16, shape[0] // 2), : min(12, shape[1] // 2)] = 0.0  # a block of zeros (with the 16 x 12 blocks)
    return w.to(dtype)


def _by_block(weight, block):
    """The definition, one block at a time."""
    rows, cols = weight.shape
    nr, nc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(nr, nc)
    for i in range(nr):
        for j in range(nc):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            w = weight[r, c].float()
            s[i, j] = torch.tensor(max(w.abs().max().item(), fp8.MIN_ABSMAX), dtype=torch.float32) / 448.0
            q[r, c] = (w / s[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.element_size() == 1
                                                                      else a, b.view(torch.uint8)
                                                                      if b.element_size() == 1 else b)


@pytest.mark.parametrize("shape,block", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_is_the_definition_and_round_trips(shape, block, dtype):
    weight = _weight(shape, dtype)
    q, s = fp8.quantize_reference(weight, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    q_ref, s_ref = _by_block(weight, block)
    assert _same(q, q_ref) and _same(s, s_ref)
    assert q.float().abs().max() == 448.0 and not q.float().isnan().any()
    # The loader's dequantizer gives q * s per block; it is within half a float8_e4m3fn step of the weight
    # (relative 2^-4 of the value, or of the smallest normal, 2^-6, times the scale, for values below it).
    back = fp8.dequantize(q, s, block)
    scale = s.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]
    bound = torch.maximum(weight.float().abs() * 2**-4, scale * 2**-9)
    assert ((back - weight.float()).abs() <= bound).all()
    assert _same(fp8.quantize_reference(back, block)[0], q)  # quantizing the dequantized weight: the same bytes


@pytest.mark.triton
@pytest.mark.parametrize("shape,block", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernel_equals_the_reference_bit_for_bit(shape, block, dtype):
    weight = _weight(shape, dtype, seed=1)
    q, s = fp8.quantize_triton(weight, block)
    q_ref, s_ref = fp8.quantize_reference(weight, block)
    assert q.dtype == torch.float8_e4m3fn
    assert _same(s, s_ref)
    assert _same(q, q_ref)


def test_scheme_quantizes_the_decoder_linear_weights_only():
    scheme = fp8.Fp8Scheme(4, keep_layers=1)
    quantized = [
        "model.layers.1.self_attn.q_proj.weight", "model.layers.2.mlp.experts.3.down_proj.weight",
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.2.mlp.shared_experts.gate_proj.weight",
        # Qwen3.5's vision-language checkpoint: its text model's layers; the DeltaNet's q, k, v, z and output
        "model.language_model.layers.1.linear_attn.in_proj_qkv.weight",
        "model.language_model.layers.2.linear_attn.out_proj.weight", "model.layers.1.linear_attn.in_proj_qkvz.weight",
    ]
    kept = [
        "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight",  # first / last layer
        "model.layers.1.self_attn.q_proj.bias", "model.layers.4.eh_proj.weight",  # a bias; an MTP layer
        # the DeltaNet's per-value-head beta / decay projections (Qwen3.5 apart, Qwen3-Next fused), Qwen3.5's
        # shared-expert gate, vision tower and MTP layer
        "model.language_model.layers.1.linear_attn.in_proj_b.weight",
        "model.language_model.layers.1.linear_attn.in_proj_a.weight", "model.layers.2.linear_attn.in_proj_ba.weight",
        "model.language_model.layers.2.mlp.shared_expert_gate.weight", "model.visual.blocks.0.attn.qkv.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
    ]
    for name in quantized:
        assert scheme.quantizes(name, (256, 128)), name
    for name in kept:
        one_dim = name.endswith(("norm.weight", "bias"))  # norms and biases are 1-D: not linear weights
        assert not scheme.quantizes(name, (256,) if one_dim else (256, 128)), name
    assert fp8.Fp8Scheme(4).quantizes("model.layers.0.self_attn.q_proj.weight", (256, 128))
    config = scheme.quantization_config()
    assert config["quant_method"] == "fp8" and config["fmt"] == "e4m3"
    assert config["weight_block_size"] == [128, 128] and config["activation_scheme"] == "dynamic"
    kept = config["modules_to_not_convert"]
    assert {"model.layers.0", "model.layers.3", "lm_head", "model.embed_tokens", "mlp.gate", "model.visual",
            "linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.in_proj_ba"} <= set(kept)
    assert "model.layers.1" not in kept
    assert fp8.block_size({"quantization_config": config}) == (128, 128)


def test_quantized_stream_puts_each_scale_before_its_weight():
    scheme = fp8.Fp8Scheme(1, block=(16, 16))
    g = torch.Generator().manual_seed(0)
    stream = [("model.embed_tokens.weight", torch.randn(40, 16, generator=g)),
              ("model.layers.0.self_attn.o_proj.weight", torch.randn(33, 16, generator=g)),
              ("model.layers.0.input_layernorm.weight", torch.ones(16))]
    out = list(fp8.quantized_stream(stream, scheme))
    names = [n for n, _ in out]
    assert names == ["model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight_scale_inv",
                     "model.layers.0.self_attn.o_proj.weight", "model.layers.0.input_layernorm.weight"]
    q, s = fp8.quantize_reference(stream[1][1], (16, 16))
    assert _same(out[2][1], q) and out[2][1].dtype == torch.float8_e4m3fn and _same(out[1][1], s)
    assert out[0][1] is stream[0][1] and out[3][1] is stream[2][1]
