"""On a CUDA machine (bench/gpu_check.sh): the triton backend of the log-prob op and the fused sequence loss in bf16.

Against float64 naive on the bf16 inputs (max |a - e| / max |e|): log-probs, entropies and the loss within 1e-4
(fp32 statistics of exact bf16 products), gradients within 2e-2 (the logits' gradient and the two gradient GEMMs'
outputs are bf16, 2^-9 each); and more accurate than naive bf16 logits + log_softmax. Gradient chunks (fp32
accumulation of the weight gradient) equal one chunk; ``backend="auto"`` picks the kernels for bf16 CUDA inputs;
the free-memory chunk size fits its budget. Ragged sizes (T, V not multiples of a tile) throughout.

Skipped without CUDA. ``GSPO_GPU_TESTS_ON_CPU=1`` runs the same checks on the CPU under Triton's interpreter, in
fp16 (the interpreter cannot run a bf16 ``tl.dot``) and with tiny shapes, to check the harness.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CPU = os.environ.get("GSPO_GPU_TESTS_ON_CPU") == "1"
if ON_CPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
pytestmark = [pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason="needs CUDA (bench/gpu_check.sh)"),
              pytest.mark.triton]

DEVICE = torch.device("cpu") if ON_CPU or not torch.cuda.is_available() else torch.device("cuda")
DTYPE = torch.float16 if DEVICE.type == "cpu" else torch.bfloat16
# (tokens, hidden, vocab, sequence length): ragged on purpose
SHAPE = (60, 24, 75, 12) if DEVICE.type == "cpu" else (2000, 512, 20011, 250)
VALUES, GRADS = 1e-4, 2e-2


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


@pytest.fixture(scope="module")
def case():
    tokens, hidden_size, vocab, _ = SHAPE
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g).to(DEVICE, DTYPE)
    weight = (torch.randn(vocab, hidden_size, generator=g) * 2 * hidden_size ** -0.5).to(DEVICE, DTYPE)
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(DEVICE)
    grads = torch.randn(2, tokens, generator=g, dtype=torch.float64).to(DEVICE)
    return hidden, weight, targets, grads


def naive(hidden, weight, targets, grads, temperature=0.8, dtype=torch.float64, entropy=True):
    """Values and gradients of naive logits in ``dtype`` (float64: the reference; bf16: the naive GPU path)."""
    h = hidden.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    logp_all = torch.log_softmax((h @ w.T).double() / temperature, dim=-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    ((logp * grads[0]).sum() + ((ent * grads[1]).sum() if entropy else 0)).backward()
    return {"logp": logp.detach(), "entropy": ent.detach(), "hidden_grad": h.grad, "weight_grad": w.grad}


def op(hidden, weight, targets, grads, temperature=0.8, **kwargs):
    from gspo_megatron.ops import vocab_parallel_logprobs

    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(h, w, targets, temperature=temperature, return_entropy=True, **kwargs)
    ((logp * grads[0]).sum() + (ent * grads[1]).sum()).backward()
    return {"logp": logp.detach(), "entropy": ent.detach(), "hidden_grad": h.grad, "weight_grad": w.grad}


def test_op_matches_float64_and_beats_naive_bf16(case):
    expected = naive(*case)
    got = op(*case, backend="triton")
    assert got["logp"].device.type == DEVICE.type and got["logp"].dtype == torch.float32
    assert got["hidden_grad"].dtype == got["weight_grad"].dtype == DTYPE
    for name, tol in (("logp", VALUES), ("entropy", VALUES), ("hidden_grad", GRADS), ("weight_grad", GRADS)):
        assert rel(got[name], expected[name]) <= tol, (name, rel(got[name], expected[name]))
    naive_16 = naive(*case, dtype=DTYPE)  # logits rounded to 16 bits before the softmax
    assert rel(got["logp"], expected["logp"]) < rel(naive_16["logp"], expected["logp"])


def test_gradient_chunks_equal_one_chunk(case):
    one = op(*case, backend="triton", chunk_size=SHAPE[0])
    chunks = op(*case, backend="triton", chunk_size=SHAPE[0] // 3 + 1)  # three chunks: fp32 weight-grad accumulation
    for name in one:
        assert rel(chunks[name], one[name]) <= (GRADS if name.endswith("grad") else 1e-6), name


def test_sequence_loss_matches_float64(case):
    from gspo_megatron.ops import vocab_parallel_sequence_loss

    hidden, weight, targets, grads = case
    tokens, _, _, seq = SHAPE
    b = tokens // seq
    expected = naive(hidden, weight, targets, grads, entropy=False)
    per_sequence = grads[0].view(b, seq)
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    out = vocab_parallel_sequence_loss(h.view(b, seq, -1).transpose(0, 1), w, targets.view(b, seq).t(),
                                       lambda s, logp, e: ((logp * per_sequence[s]).sum(), {}), temperature=0.8)
    out.loss.backward()
    assert rel(out.logp.reshape(-1), expected["logp"]) <= VALUES
    assert rel(out.loss, (expected["logp"] * grads[0]).sum()) <= VALUES
    assert rel(h.grad, expected["hidden_grad"]) <= GRADS and rel(w.grad, expected["weight_grad"]) <= GRADS


@pytest.mark.skipif(DEVICE.type == "cpu", reason="auto picks the kernels for CUDA inputs only")
def test_auto_runs_the_kernels_on_bf16_cuda_inputs(case, monkeypatch):
    from gspo_megatron.ops import _triton_kernels as kernels

    calls = []
    original = kernels.shard_stats
    monkeypatch.setattr(kernels, "shard_stats", lambda *a, **k: calls.append(1) or original(*a, **k))
    op(*case)
    assert calls == [1]


@pytest.mark.skipif(DEVICE.type == "cpu", reason="the CPU's chunk size is fixed (CHUNK_ELEMENTS)")
def test_auto_chunk_size_fits_its_share_of_free_memory():
    from gspo_megatron.ops.logprob import GPU_BUFFER_FRACTION, MIN_CHUNK_TOKENS, auto_chunk_size

    free, _ = torch.cuda.mem_get_info()
    free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    chunk = auto_chunk_size(151936, DEVICE, 2)
    assert chunk >= MIN_CHUNK_TOKENS
    assert chunk * 151936 * 2 <= GPU_BUFFER_FRACTION * free + 151936 * 2
    assert chunk * 151936 * 2 > GPU_BUFFER_FRACTION * free - 151936 * 2 or chunk == MIN_CHUNK_TOKENS
