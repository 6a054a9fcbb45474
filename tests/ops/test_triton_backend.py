"""The Triton backend of the log-prob op and of the fused sequence loss, run by Triton's interpreter on CPU tensors.

``TRITON_INTERPRET=1`` is set here, before the kernels are first imported (triton reads it when a kernel is
defined; nothing else in the suite imports ``ops._triton_kernels``), and the spawned TP ranks inherit it.

- The kernels alone against the torch backend's own pieces on the same logits: ``shard_stats`` equals
  ``_shard_softmax.shard_stats_`` and ``logits_grad`` equals ``logits_grad_``, with a vocabulary that is not a
  multiple of the tile, targets outside the shard, several vocabulary slices merged, a temperature, and
  ``merge_shard_stats`` of column blocks equals the statistics of the whole.
- The op and the sequence loss with ``backend="triton"`` against the naive formula (forward and backward, entropy,
  temperature, chunking, padded vocabulary), and the op against the torch backend; TP=2 on two gloo ranks, with and
  without sequence parallelism, every case in one launch.

Operands: fp32 (IEEE dot) and fp16, the 16-bit path (the interpreter cannot run a bf16 ``tl.dot``,
triton-lang/triton#11584; bf16 runs in tests/gpu on a GPU). Tolerances, max |a - e| / max |e| against float64 naive
on the inputs rounded to the operand dtype: fp32 1e-5 for everything; fp16 1e-5 for log-probs, entropies and the
loss (fp32 statistics of exact fp16 products) and 2e-3 for gradients (the logits' gradient and the two gradient
GEMMs' outputs are rounded to fp16, 2^-11 each). Shapes are tiny: the interpreter runs each program in Python.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from gspo_megatron.ops import _triton_kernels as kernels  # noqa: E402
from gspo_megatron.ops import vocab_parallel_logprobs  # noqa: E402
from gspo_megatron.ops._shard_softmax import logits_grad_, merge_shard_stats, shard_stats_  # noqa: E402
from gspo_megatron.ops.logprob import select_backend  # noqa: E402
from gspo_megatron.parallel.groups import Layout  # noqa: E402
from gspo_megatron.parallel.launch import run_on_ranks  # noqa: E402
from tests.ops import test_logprob_op as op_tests  # noqa: E402
from tests.ops import test_sequence_loss as loss_tests  # noqa: E402
from tests.ops.common import diffs, rel_diff  # noqa: E402

pytestmark = pytest.mark.triton  # runs again under the megatron-core 0.19 environment's own Triton

DTYPES = (torch.float32, torch.float16)
GRADS = ("hidden_grad", "weight_grad")


def tolerance(dtype: torch.dtype, tensor: str) -> float:
    return 2e-3 if dtype == torch.float16 and tensor in GRADS else 1e-5


def rounded(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float64 values the op sees in ``dtype``."""
    return tensor.to(dtype).double()


def assert_within(got: dict, expected: dict, dtype: torch.dtype, where: str = "") -> None:
    for tensor, d in diffs(got, expected).items():
        assert d <= tolerance(dtype, tensor), (where, tensor, d)


# ---- the kernels --------------------------------------------------------------------------------------------------


def _logits_case(dtype, tokens=37, hidden=20, vocab=45, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype)
    targets = torch.randint(-5, vocab + 5, (tokens,), generator=g)  # some owned by other shards
    return h, w, targets


@pytest.mark.parametrize("dtype", DTYPES)
# 16-wide tiles: 3 vocabulary slices of one tile; 32-wide with an 8-wide reduction step: 2 slices, ragged H and V
@pytest.mark.parametrize("config", [kernels.KernelConfig(16, 16, 16), kernels.KernelConfig(16, 32, 8)])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_stats_kernel_equals_torch_statistics(dtype, config, with_entropy):
    h, w, targets = _logits_case(dtype)
    z = (h.double() @ w.double().T) / 0.7
    expected = torch.empty(h.shape[0], 4, dtype=torch.float64)
    shard_stats_(z, targets, with_entropy, expected)
    assert kernels._splits(h.shape[0], w.shape[0], config, h.device)[0] > 1  # the merge is exercised
    got = kernels.shard_stats(h, w, targets, 0.7, with_entropy, config=config)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert rel_diff(got, expected) <= 1e-6


def test_merged_column_blocks_equal_the_whole():
    z = torch.randn(9, 50, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    targets = torch.arange(9) * 5
    whole = torch.empty(9, 4, dtype=torch.float64)
    shard_stats_(z.clone(), targets, True, whole)
    parts = []
    for start, stop in ((0, 7), (7, 30), (30, 50)):
        part = torch.empty(9, 4, dtype=torch.float64)
        shard_stats_(z[:, start:stop].clone(), targets - start, True, part)
        parts.append(part)
    assert rel_diff(merge_shard_stats(torch.stack(parts)), whole) <= 1e-13


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_entropy", [True, False])
def test_grad_kernel_equals_torch_logits_grad(dtype, with_entropy):
    h, w, targets = _logits_case(dtype, seed=2)
    temperature = 0.7
    z = (h.double() @ w.double().T) / temperature
    g = torch.Generator().manual_seed(3)
    lse = torch.logsumexp(z, dim=1)
    entropy, grad_logp, grad_entropy = torch.rand(h.shape[0], generator=g), *torch.randn(2, h.shape[0], generator=g)
    expected = logits_grad_(z.clone(), targets, lse, entropy.double() if with_entropy else None, grad_logp.double(),
                            grad_entropy.double() if with_entropy else None, temperature)
    out = torch.empty(h.shape[0], w.shape[0], dtype=dtype)
    kernels.logits_grad(h, w, targets, lse.float(), entropy if with_entropy else None, -grad_logp / temperature,
                        -grad_entropy / temperature if with_entropy else None, temperature, out)
    assert rel_diff(out, expected) <= (2e-3 if dtype == torch.float16 else 1e-6)


# ---- the op and the sequence loss at TP = 1 -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [7, None])  # several gradient chunks (fp32 accumulation), and one
def test_op_matches_naive_and_the_torch_backend(dtype, temperature, chunk_size):
    hidden, weight, targets, grads = op_tests.make_case()
    got = op_tests.fused(hidden, weight, targets, grads, temperature, dtype, chunk_size=chunk_size, backend="triton")
    expected = op_tests.reference(rounded(hidden, dtype), rounded(weight, dtype), targets, grads, temperature)
    assert_within(got, expected, dtype)
    assert got["hidden_grad"].dtype == got["weight_grad"].dtype == dtype and got["logp"].dtype == torch.float32
    torch_path = op_tests.fused(hidden, weight, targets, grads, temperature, dtype, chunk_size=chunk_size,
                                backend="torch")
    assert_within(got, torch_path, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_logprob_only_padded_vocab_sbh_and_entropy_gradient_alone(dtype):
    case = op_tests.make_case(shape=(5, 3), vocab=40, vocab_size=35, seed=1)
    got = op_tests.fused(*case, 0.7, dtype, entropy=False, chunk_size=4, vocab_size=35, backend="triton")
    expected = op_tests.reference(rounded(case[0], dtype), rounded(case[1], dtype), case[2], case[3], 0.7,
                                  vocab_size=35, entropy=False)
    assert_within(got, expected, dtype)
    assert got["logp"].shape == (5, 3) and got["weight_grad"][35:].abs().max() == 0

    hidden, weight, targets, grads = op_tests.make_case(seed=2)
    grads[0] = 0
    h = hidden.to(dtype).requires_grad_()
    _, ent = vocab_parallel_logprobs(h, weight.to(dtype), targets, temperature=0.7, return_entropy=True,
                                     chunk_size=5, backend="triton")
    (ent * grads[1].to(dtype)).sum().backward()  # the log-prob's upstream gradient is None inside the op
    expected = op_tests.reference(rounded(hidden, dtype), rounded(weight, dtype), targets, grads, 0.7)
    assert rel_diff(h.grad, expected["hidden_grad"]) <= tolerance(dtype, "hidden_grad")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("chunk_size", [4, None])  # gradient chunks shorter than a sequence (s = 6), and one
def test_sequence_loss_matches_naive(dtype, entropy, chunk_size):
    hidden, weight, targets, data = loss_tests.make_case()
    calls = []
    got = loss_tests.fused(hidden, weight, targets, data, 0.7, entropy, dtype, calls=calls, chunk_size=chunk_size,
                           backend="triton")
    expected = loss_tests.reference(rounded(hidden, dtype), rounded(weight, dtype), targets, data, 0.7, entropy)
    assert_within(got, expected, dtype)
    assert calls == [slice(0, loss_tests.B)]  # statistics first, then the loss once for every sequence


def test_the_triton_backend_is_what_runs(monkeypatch):
    calls = []
    for name in ("shard_stats", "logits_grad"):
        original = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    hidden, weight, targets, grads = op_tests.make_case()
    op_tests.fused(hidden, weight, targets, grads, 1.0, torch.float32, chunk_size=13, backend="triton")
    assert calls == ["shard_stats", "logits_grad", "logits_grad"]  # 26 tokens: two gradient chunks


def test_backend_selection():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert select_backend("auto", cuda, torch.bfloat16) == "triton"
    assert select_backend("auto", cuda, torch.float16) == "triton"
    assert select_backend("auto", cuda, torch.float32) == "torch"  # fp32 models keep fp32 GEMMs (TF32 off)
    assert select_backend("auto", cpu, torch.bfloat16) == "torch"  # the CPU path, as benchmarked
    assert select_backend("auto", cuda, torch.bfloat16, torch.float32) == "torch"  # the kernels take one dtype
    assert select_backend("triton", cpu, torch.float16) == "triton"  # here: TRITON_INTERPRET=1
    with pytest.raises(ValueError, match="takes bf16, fp16 or fp32 inputs of one dtype"):
        select_backend("triton", cpu, torch.float64)
    with pytest.raises(ValueError, match="hidden torch.bfloat16 and weight torch.float32"):
        select_backend("triton", cpu, torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="backend must be one of"):
        select_backend("cuda", cpu, torch.float32)


# ---- TP = 2 (one launch) ------------------------------------------------------------------------------------------


def tp2_check_all() -> dict:
    """Both ops' TP=2 cases with the triton backend, fp32 and fp16 -> {op/case/dtype/tensor: (rel diff, tolerance)}."""
    from megatron.core import parallel_state as ps

    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    out = {}
    for seed, (name, (shape, sp, temperature, chunk, entropy, vocab_size)) in enumerate(op_tests.TP2_CASES.items()):
        hidden, weight, targets, grads = op_tests.make_case(shape=shape, vocab=40, vocab_size=vocab_size, seed=seed)
        rows = slice(rank * 20, (rank + 1) * 20)
        tokens = slice(rank * shape[0] // 2, (rank + 1) * shape[0] // 2) if sp else slice(None)
        for dtype in DTYPES:
            expected = op_tests.reference(rounded(hidden, dtype), rounded(weight, dtype), targets, grads, temperature,
                                          vocab_size, entropy)
            expected["weight_grad"] = expected["weight_grad"][rows]
            expected["hidden_grad"] = expected["hidden_grad"][tokens]
            got = op_tests.fused(hidden[tokens], weight[rows], targets, grads, temperature, dtype, entropy,
                                 tp_group=group, chunk_size=chunk, sequence_parallel=sp, vocab_size=vocab_size,
                                 backend="triton")
            for tensor, d in diffs(got, expected).items():
                out[f"logprob/{name}/{str(dtype)[6:]}/{tensor}"] = (d, tolerance(dtype, tensor))
    S, V = loss_tests.S, loss_tests.V
    for seed, (name, (sp, temperature, chunk, entropy, vocab_size)) in enumerate(loss_tests.TP2_CASES.items()):
        hidden, weight, targets, data = loss_tests.make_case(vocab_size=vocab_size, seed=seed)
        rows = slice(rank * V // 2, (rank + 1) * V // 2)
        positions = slice(rank * S // 2, (rank + 1) * S // 2) if sp else slice(None)
        for dtype in DTYPES:
            expected = loss_tests.reference(rounded(hidden, dtype), rounded(weight, dtype), targets, data, temperature,
                                            entropy, vocab_size)
            expected["weight_grad"] = expected["weight_grad"][rows]
            expected["hidden_grad"] = expected["hidden_grad"][positions]
            got = loss_tests.fused(hidden[positions], weight[rows], targets, data, temperature, entropy, dtype,
                                   tp_group=group, chunk_size=chunk, sequence_parallel=sp, vocab_size=vocab_size,
                                   backend="triton")
            for tensor, d in diffs(got, expected).items():
                out[f"sequence_loss/{name}/{str(dtype)[6:]}/{tensor}"] = (d, tolerance(dtype, tensor))
    return out


@pytest.fixture(scope="module")
def tp2_results():
    return run_on_ranks(tp2_check_all, 2, Layout(tensor=2))


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_matches_naive(tp2_results, rank):
    results = tp2_results[rank]
    minimum = 2 * (3 * len(op_tests.TP2_CASES) + 4 * len(loss_tests.TP2_CASES))
    assert len(results) >= minimum, len(results)
    bad = {k: d for k, (d, tol) in results.items() if d > tol}
    assert not bad, bad
