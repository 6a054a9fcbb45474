"""SGLang's CPU server serves block-FP8 models (FP8 rollouts, issue 41) through patches/sglang_cpu's torch stand-in of
its W8A8 block GEMM (``_gspo_fp8_block``), and what it serves is FP8's arithmetic, not the unquantized model's:

- the stand-in's linear equals SGLang's own Triton ``w8a8_block_fp8_matmul`` (run by Triton's interpreter on CPU
  tensors, partial blocks) to fp32 summation order, and its activation groups and experts equal the naive formulas;
- a launched fp32 server on the block-FP8 copy of a tiny Qwen3-MoE or Qwen3.5-MoE (sizes in multiples of the 128 x 128
  block, as SGLang requires of merged projections) answers log-probs equal to W8A8 done by hand on transformers' model
  (weights quantized per block and back, each quantized linear's input per 1 x 128 group and back): the median token
  within ``W8A8_MEDIAN_TOL``, 90% of them within ``W8A8_TOL``,
  while the unquantized model is far off (FP8 changes the numbers; a server computing in high precision fails);
- after FP8 weight syncs of a trained model (distributed and disk), the server answers the new weights' W8A8
  log-probs: every update lands in the FP8 layers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gspo_megatron.model.fp8 import Fp8Scheme, dequantize, quantize_reference
from gspo_megatron.rollout import SamplingParams, WeightSyncConfig, flatten
from gspo_megatron.rollout import hf_weights
from tests.sglang_servers import own_engine, server_config

from .helpers import import_from_cpu_site, prompts, require_sglang
from .test_weight_sync import _rollout, _train_step

REPO = Path(__file__).resolve().parents[2]
BLOCK = (128, 128)
# fp32 server against fp32 transformers, both W8A8, per response token. Most tokens agree to float32 rounding
# (measured median 2e-7 to 5e-7, max 4e-6), but not all: an activation within float32 rounding of the midpoint of two
# float8 values rounds either way depending on the order of summation, and one flipped element moves its token's
# log-prob and, through attention or the DeltaNet's state, the rest of its sequence (measured up to 0.15, 0-2% of
# tokens). So: the median within W8A8_MEDIAN_TOL and at least W8A8_SHARE of the tokens within W8A8_TOL.
W8A8_MEDIAN_TOL, W8A8_TOL, W8A8_SHARE = 1e-5, 1e-4, 0.9
FP8_GAP = 1e-2  # the unquantized model's (or the old weights') median distance from the server must exceed this
# Sizes in multiples of 128: SGLang refuses a merged projection (qkv, gate_up) whose parts are not whole blocks.
SIZES = dict(vocab_size=128, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=32,
             num_experts=4, top_k=2, moe_intermediate_size=128)


@pytest.fixture(scope="module")
def block():
    return import_from_cpu_site("_gspo_fp8_block")


def test_activation_groups_quantize_each_group_of_a_row_on_its_own(block):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 300, generator=g) * torch.tensor([1.0, 100.0, 1e-3])[:, None]  # rows of other scales
    x[2, 256:] = 0  # a partial group of zeros
    out = block.quantize_activation_groups(x, 128)
    for row in range(3):
        for start in range(0, 300, 128):
            part = x[row, start:start + 128]
            scale = max(part.abs().max().item(), 1e-10) / 448
            expected = (part / scale).to(torch.float8_e4m3fn).float() * scale
            assert torch.equal(out[row, start:start + 128], expected), (row, start)


def test_linear_equals_sglangs_triton_block_gemm(tmp_path):
    """The stand-in against SGLang 0.5.23's ``w8a8_block_fp8_matmul_triton`` (the kernel its GPU servers run),
    interpreted, both fed the same float8 activations and weights (K = 300, N = 200: partial blocks both ways). In a
    child process: Triton decides interpreted or compiled when a kernel is defined, and sglang may be imported
    here already. (SGLang's activation-quantization kernel crashes Triton 3.9's interpreter, a heap corruption, so
    the groups are checked against the formula above instead.)"""
    require_sglang()
    script = f"""
import os, sys, torch
sys.path.insert(0, {str(REPO / 'patches/sglang_cpu/site')!r})
import _gspo_fp8_block as block
import sglang.kernels.ops.gemm.fp8_kernel as kernels
from gspo_megatron.model.fp8 import quantize_reference
kernels.get_w8a8_block_fp8_configs = lambda *args: None  # its tuned tables are per GPU name; the default config
g = torch.Generator().manual_seed(0)
x, w = torch.randn(5, 300, generator=g), torch.randn(200, 300, generator=g) / 10
wq, ws = quantize_reference(w, (128, 128))
groups = torch.nn.functional.pad(x, (0, 84)).view(5, 3, 128)
xs = groups.abs().amax(-1).clamp_min(1e-10) / 448
xq = (groups / xs[..., None]).to(torch.float8_e4m3fn).view(5, 384)[:, :300].contiguous()
theirs = kernels.w8a8_block_fp8_matmul_triton(xq, wq, xs, ws, [128, 128], output_dtype=torch.float32)
ours = block.block_fp8_linear(x, wq, ws, [128, 128])
print((theirs - ours).abs().max().item(), theirs.abs().max().item())
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    diff, magnitude = map(float, out.stdout.split()[-2:])
    print(f"stand-in vs SGLang's Triton block GEMM: max |diff| {diff:.2e} of outputs up to {magnitude:.2f}")
    assert magnitude > 1 and diff <= 1e-5 * magnitude


def test_experts_equal_the_per_token_formula(block):
    """``_experts`` (tokens grouped by expert) against each token's top-k experts summed one by one."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(1)
    experts, hidden, inter, tokens, k = 3, 160, 136, 7, 2  # partial blocks in both GEMMs
    w13 = [quantize_reference(torch.randn(2 * inter, hidden, generator=g) / 10, BLOCK) for _ in range(experts)]
    w2 = [quantize_reference(torch.randn(hidden, inter, generator=g) / 10, BLOCK) for _ in range(experts)]
    layer = SimpleNamespace(w13_weight=torch.stack([q for q, _ in w13]),
                            w13_weight_scale_inv=torch.stack([s for _, s in w13]),
                            w2_weight=torch.stack([q for q, _ in w2]),
                            w2_weight_scale_inv=torch.stack([s for _, s in w2]))
    method = SimpleNamespace(weight_block_size=list(BLOCK), moe_runner_config=SimpleNamespace(
        activation="silu", gemm1_alpha=None, apply_router_weight_on_input=False, routed_scaling_factor=None))
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    ids[3, 1] = -1  # a slot routed to no local expert adds nothing
    weights = torch.rand(tokens, k, generator=g)
    out = block._experts(method, layer, x, (weights, ids, None))

    def w8a8(inp, pair):
        return block.quantize_activation_groups(inp[None], 128)[0] @ dequantize(*pair, BLOCK).float().T

    for t in range(tokens):
        expected = torch.zeros(hidden)
        for slot in range(k):
            e = ids[t, slot].item()
            if e < 0:
                continue
            gate, up = w8a8(x[t], w13[e]).chunk(2)
            expected += weights[t, slot] * w8a8(F.silu(gate) * up, w2[e])
        torch.testing.assert_close(out[t], expected, rtol=1e-5, atol=1e-5)


def _w8a8_logprobs(model_dir: Path, state: dict | None, samples) -> list[torch.Tensor]:
    """Each sample's response log-probs under W8A8 done by hand on transformers' fp32 model of ``model_dir`` (with
    ``state`` loaded when given): every weight the FP8 scheme quantizes is quantized per 128 x 128 block and back,
    and the input of each such linear per 1 x 128 group and back."""
    from transformers import AutoModelForCausalLM

    quantize_groups = import_from_cpu_site("_gspo_fp8_block").quantize_activation_groups
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, experts_implementation="eager")
    if state is not None:
        model.load_state_dict(state)
    scheme = Fp8Scheme(model.config.num_hidden_layers)
    quantized = set()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # transformers fuses the experts in memory ([E, out, in]; gate_up as two halves); the files (and the
            # sync) carry each expert's gate, up and down apart, each quantized in its own blocks
            experts = param.dim() == 3 and ".mlp.experts." in name
            if not (experts or scheme.quantizes(name, param.shape)):
                continue  # what the scheme keeps: embeddings, lm_head, norms, routers, the DeltaNet's a / b, conv1d
            pieces = [param] if not experts else \
                [half for expert in param for half in expert.chunk(2 if "gate_up" in name else 1)]
            for piece in pieces:
                piece.copy_(dequantize(*quantize_reference(piece, BLOCK), BLOCK))
            quantized.add(param.untyped_storage().data_ptr())
    linear = F.linear

    def w8a8_linear(x, weight, bias=None):
        if weight.untyped_storage().data_ptr() in quantized:
            x = quantize_groups(x, 128)
        return linear(x, weight, bias)

    F.linear = w8a8_linear
    try:
        return _response_logprobs(model, samples)
    finally:
        F.linear = linear


def _response_logprobs(model, samples) -> list[torch.Tensor]:
    """Each sample's response log-probs under ``model``, one sequence per forward."""
    out = []
    with torch.no_grad():
        for sample in samples:
            logprobs = torch.log_softmax(model(torch.tensor([sample.prompt_ids + sample.response_ids])).logits[0], -1)
            start = len(sample.prompt_ids) - 1
            out.append(logprobs[start:start + len(sample.response_ids)]
                       .gather(1, torch.tensor(sample.response_ids)[:, None])[:, 0])
    return out


def _gaps(samples, reference) -> tuple[float, float]:
    """(median |server - reference|, the share of tokens within W8A8_TOL) over every response token."""
    diffs = torch.cat([(torch.tensor(s.logprobs) - r).abs() for s, r in zip(samples, reference)])
    return diffs.median().item(), (diffs <= W8A8_TOL).float().mean().item()


def _w8a8_equal(gaps: tuple[float, float]) -> bool:
    return gaps[0] <= W8A8_MEDIAN_TOL and gaps[1] >= W8A8_SHARE


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def fp8_server(request, tmp_path_factory):
    """A launched fp32 server on the block-FP8 copy of a tiny Qwen3-MoE, and of Qwen3.5-MoE's text model (a gated
    DeltaNet layer, then gated attention; a gated shared expert): its DeltaNet q, k, v, z and output projections
    FP8, the beta / decay projections kept (SGLang fuses them into parts of one row per value head)."""
    require_sglang()
    from gspo_megatron.model.hf_files import quantized_copy
    from gspo_megatron.rewards import synthetic

    root = tmp_path_factory.mktemp(f"fp8_serving_{request.param}")
    plain = synthetic.save_tiny_model(root / "plain", seed=5, family=request.param, **SIZES)
    scheme = Fp8Scheme(SIZES["num_layers"])
    served = quantized_copy(plain, root / "fp8", scheme)
    config = server_config(served, root / "logs", context_length=64,
                           weight_sync=WeightSyncConfig(fp8=scheme, bucket_bytes=65536, disk_dir=str(root / "sync")))
    with own_engine(config) as engine:
        yield engine, plain


SAMPLING = SamplingParams(max_new_tokens=8)


def test_fp8_server_answers_w8a8_logprobs(fp8_server):
    engine, plain = fp8_server
    log = Path(engine.config.log_dir).glob("*.log")
    assert any("quant=fp8" in path.read_text() for path in log), "the server did not build FP8 layers"
    samples = flatten(engine.generate(prompts(6, seed=3), n=2, sampling=SAMPLING))
    w8a8 = _gaps(samples, _w8a8_logprobs(plain, None, samples))
    unquantized = _gaps(samples, _unquantized_logprobs(plain, samples))
    print(f"FP8 server vs W8A8 by hand: median {w8a8[0]:.1e}, {w8a8[1]:.1%} of tokens within {W8A8_TOL:g}; "
          f"vs the unquantized model: median {unquantized[0]:.1e}")
    assert _w8a8_equal(w8a8) and unquantized[0] > FP8_GAP


def _unquantized_logprobs(model_dir: Path, samples) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return _response_logprobs(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32), samples)


@pytest.mark.parametrize("method", ["distributed", "disk"])
def test_fp8_syncs_land_in_the_servers_fp8_layers(fp8_server, method):
    """Train the model a step, sync it as block FP8: the server then answers the trained weights' W8A8 log-probs,
    and the old weights' are clearly off (the update landed)."""
    from transformers import AutoModelForCausalLM

    engine, plain = fp8_server
    version = f"fp8-{method}"
    trainer = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32)
    if method == "disk":  # the second sync: move on from the first one's weights
        trainer.load_state_dict(torch.load(plain.parent / "trained.pt"))
    old_state = {k: v.clone() for k, v in trainer.state_dict().items()}
    _, batch = _rollout(engine, seed=10)
    _train_step(trainer, batch)
    stats = engine.update_weights(hf_weights.checkpoint_tensors(trainer), version, method=method)
    assert stats.weight_version == version and engine.weight_version() == version
    torch.save(trainer.state_dict(), plain.parent / "trained.pt")
    samples = flatten(engine.generate(prompts(6, seed=4), n=2, sampling=SAMPLING))
    assert {s.weight_version for s in samples} == {version}
    now = _gaps(samples, _w8a8_logprobs(plain, trainer.state_dict(), samples))
    before = _gaps(samples, _w8a8_logprobs(plain, old_state, samples))
    print(f"{method} FP8 sync: server vs W8A8 of the trained weights: median {now[0]:.1e}, {now[1]:.1%} of tokens "
          f"within {W8A8_TOL:g}; of the old ones: median {before[0]:.1e}")
    assert _w8a8_equal(now) and before[0] > FP8_GAP



@pytest.mark.megatron  # trains the Megatron policy through the CLI
def test_the_loop_rolls_out_in_fp8_through_the_cli(tmp_path):
    """``train`` with ``rollout.fp8`` on a launched bf16 CPU server (bf16: what SGLang's FP8 layers compute in on
    GPUs), the user's command: the server starts from the block-FP8 copy, and each step's sync streams every weight
    the scheme quantizes as float8 with its fp32 scale (the tensors and bytes counted from the checkpoint), the rest
    in the trainer's fp32. The engine's log-probs sit FP8's distance from the trainer's, finite."""
    from safetensors import safe_open

    from tests import warm_cli

    require_sglang()
    run, steps = tmp_path / "run", 2
    command = [sys.executable, "-m", "gspo_megatron.cli", "train", str(REPO / "examples/tiny_moe_cpu.yaml"),
               "rollout.fp8=true", "rollout.server_args.dtype=bfloat16", "model.tiny.num_kv_heads=4",
               "model.tiny.moe_intermediate_size=128", f"train.steps={steps}", "train.eval_every=0",
               "model.warm_start_steps=2", f"model.hf_dir={tmp_path / 'model'}", f"logging.dir={run}",
               f"checkpoint.dir={run / 'ck'}", "logging.plot_every=0", "rollout.prompts_per_step=4",
               "parallel.micro_batch_size=8", "data.reward_workers=0"]
    out = warm_cli.run(command, capture_output=True, text=True, cwd=REPO, env=dict(os.environ, WORLD_SIZE="1"),
                       timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    scheme = Fp8Scheme(SIZES["num_layers"])
    served = json.loads((run / "engine_model" / "config.json").read_text())
    assert served["quantization_config"] == scheme.quantization_config()
    with safe_open(tmp_path / "model" / "model.safetensors", "pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    quantized = {name: shape for name, shape in shapes.items() if scheme.quantizes(name, shape)}
    assert len(quantized) == 2 * (4 + 3 * SIZES["num_experts"])  # q, k, v, o and each expert's gate, up, down

    def blocks(rows, cols):
        return -(-rows // BLOCK[0]) * -(-cols // BLOCK[1])

    fp8_bytes = sum(r * c + 4 * blocks(r, c) for r, c in quantized.values())
    other_bytes = sum(4 * math.prod(shape) for name, shape in shapes.items() if name not in quantized)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert r["weight_sync/tensors"] == len(shapes) + len(quantized)  # each quantized weight and its scale
        assert r["weight_sync/gb"] == pytest.approx((fp8_bytes + other_bytes) / 1e9, rel=1e-9)
        # bf16 + FP8 against the fp32 trainer (measured mean 0.03-0.04 per token; an fp32 server's is ~1e-6)
        assert 1e-3 < r["logprob_diff_mean"] < 0.2 and math.isfinite(r["loss"]), r
    print("FP8 loop:", [(r["logprob_diff_mean"], r["logprob_diff_max"]) for r in records])


def test_rollout_fp8_refuses_sizes_sglangs_fp8_layers_cannot_hold():
    """Pre-flight, before the FP8 copy is written: the CPU example's own sizes (k and v of 2 heads x 32 = 64 rows, a
    128-row block) are refused naming the field, and so is a server TP size that splits whole blocks."""
    from gspo_megatron.train.startup.bootstrap import rollout_fp8_scheme
    from gspo_megatron.train.startup.config import ConfigError, load_config
    from gspo_megatron.rewards.synthetic import tiny_config

    example = REPO / "examples/tiny_moe_cpu.yaml"
    cfg = load_config(str(example), ["rollout.fp8=true", "rollout.server_args.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"num_key_value_heads x head_dim = 64, not a multiple .* 128 rows"):
        rollout_fp8_scheme(cfg, tiny_config(**cfg.model.tiny).to_dict())
    sizes = {**cfg.model.tiny, **{k: SIZES[k] for k in ("num_kv_heads", "moe_intermediate_size")}}
    assert rollout_fp8_scheme(cfg, tiny_config(**sizes).to_dict()) == Fp8Scheme(SIZES["num_layers"])
    cfg = load_config(str(example), ["rollout.fp8=true", "rollout.server_args.tp_size=2"])
    with pytest.raises(ConfigError, match=r"= 128, not a multiple .* each of 2 server TP rank\(s\).* smaller "
                                          r"rollout.server_args.tp_size"):
        rollout_fp8_scheme(cfg, tiny_config(**sizes).to_dict())
