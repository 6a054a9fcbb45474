"""Block-FP8 layers (``quantization_config`` fp8, ``weight_block_size`` [128, 128]) on a CPU SGLang server: a torch
stand-in for the GEMMs SGLang 0.5.23 runs only on GPUs or AMX CPUs.

Without ``SGLANG_USE_CPU_ENGINE`` (whose sgl-kernel CPU build PyPI lacks) SGLang sends ``Fp8LinearMethod`` and
``Fp8MoEMethod`` down their GPU path: the weights load as float8_e4m3fn with their fp32 ``weight_scale_inv``, then the
first forward dies in the Triton block-FP8 GEMM ("0 active drivers"). These stand-ins compute what that GEMM computes
(W8A8 with dynamic activation scales, SGLang's ``per_token_group_quant_fp8`` + ``w8a8_block_fp8_matmul``):

- each 1 x 128 group of an activation row is quantized to float8_e4m3fn with scale absmax / 448 (floored at 1e-10);
- each 128 x 128 block of the weight is its float8 values times its ``weight_scale_inv``;
- the product of the two dequantized operands accumulates in float32 and is rounded to the activations' dtype once.

The expert GEMMs quantize their inputs the same way (the hidden state before gate_up, the activated intermediate
before down), as SGLang's Triton fused MoE does with block quantization. The products are equal in value to the GPU
kernels' up to float32 summation order; the speed is not (dequantized weights, no FP8 arithmetic): this is a CPU
stand-in for testing FP8 rollouts' numbers, not a way to serve FP8 fast.
"""

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
EPS = 1e-10  # per_token_group_quant_fp8's floor of a group's absmax


def quantize_activation_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] through float8 per 1 x ``group`` block and back, in float32 (SGLang's dynamic activation scales)."""
    k = x.shape[-1]
    pad = (-k) % group
    rows = F.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], (k + pad) // group, group)
    scale = rows.abs().amax(dim=-1, keepdim=True).clamp_min(EPS) / FP8_MAX
    q = (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (q.float() * scale).reshape(*x.shape[:-1], k + pad)[..., :k]


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: list) -> torch.Tensor:
    """A float8 weight [..., N, K] times its per-block scales [..., ceil(N / bn), ceil(K / bk)], in float32. (The
    trainer's ``model.fp8.dequantize`` in the server's own terms: a server's process does not import gspo_megatron.)"""
    bn, bk = block
    n, k = weight.shape[-2:]
    scales = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return weight.float() * scales


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: list,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) with x's 1 x bk groups and W's bn x bk blocks in float8, accumulated in float32."""
    out = quantize_activation_groups(x, block[1]) @ dequantize_blocks(weight, scale_inv, block).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def install(fp8_module) -> None:
    """Replace ``Fp8LinearMethod.apply`` and ``Fp8MoEMethod.apply`` for block-quantized layers on CPU tensors, and
    let an fp32 server load an FP8 checkpoint (SGLang allows bf16 and fp16 activations only, which its GPU kernels
    need; the stand-in computes in any dtype, and fp32 makes the FP8 weights' effect measurable apart from bf16's)."""
    linear_apply = fp8_module.Fp8LinearMethod.apply
    moe_apply = fp8_module.Fp8MoEMethod.apply

    def apply_linear(self, layer, x, bias=None):
        if not (self.block_quant and isinstance(x, torch.Tensor) and x.device.type == "cpu"):
            return linear_apply(self, layer, x, bias)
        return block_fp8_linear(x, layer.weight, layer.weight_scale_inv, self.weight_block_size, bias)

    def apply_moe(self, layer, dispatch_output):
        x = dispatch_output.hidden_states
        if not (self.block_quant and x.device.type == "cpu"):
            return moe_apply(self, layer, dispatch_output)
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        return StandardCombineInput(hidden_states=_experts(self, layer, x, dispatch_output.topk_output))

    act_dtypes = fp8_module.Fp8Config.get_supported_act_dtypes.__func__
    fp8_module.Fp8Config.get_supported_act_dtypes = classmethod(lambda cls: [*act_dtypes(cls), torch.float32])
    fp8_module.Fp8LinearMethod.apply = apply_linear
    fp8_module.Fp8MoEMethod.apply = apply_moe


def _experts(method, layer, x: torch.Tensor, topk_output) -> torch.Tensor:
    """The routed experts' weighted sum for each token: gate_up, SiLU-and-multiply, down, each GEMM block-FP8."""
    config = method.moe_runner_config
    if config.activation != "silu" or config.gemm1_alpha is not None or config.apply_router_weight_on_input \
            or getattr(layer, "w13_weight_bias", None) is not None or config.routed_scaling_factor not in (None, 1.0):
        raise NotImplementedError("the CPU block-FP8 MoE stand-in (patches/sglang_cpu) runs plain SiLU-gated experts "
                                  "without biases or a routed scaling factor only")
    topk_weights, topk_ids, _ = topk_output
    block = method.weight_block_size
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for expert in topk_ids.unique().tolist():
        if expert < 0:  # a slot routed to no local expert
            continue
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = block_fp8_linear(x[token], layer.w13_weight[expert], layer.w13_weight_scale_inv[expert], block)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = (F.silu(gate.float()) * up.float()).to(x.dtype)
        down = block_fp8_linear(hidden, layer.w2_weight[expert], layer.w2_weight_scale_inv[expert], block)
        out.index_add_(0, token, down.float() * topk_weights[token, slot, None].float())
    return out.to(x.dtype)
