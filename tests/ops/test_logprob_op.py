"""vocab_parallel_logprobs equals the naive formula: log_softmax(hidden @ W.T / temperature).gather(target), and
the full-softmax entropy -- values and gradients w.r.t. hidden and weight, under a random upstream gradient for
both outputs.

Tolerances: max |a - e| / max |e| per tensor against a float64 naive reference, <= 1e-5 for the op in fp32 and
<= 1e-12 for the op in float64 (which shows the algorithm is exact, not merely close). TP=2 runs on two gloo ranks
(weight split by rows; each rank checks its weight-gradient shard and its hidden gradient), with and without
sequence parallelism, all cases in one launch.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gspo_megatron.ops import vocab_parallel_logprobs
from gspo_megatron.ops.reference import naive_logprobs
from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from tests.ops.common import TOL, assert_rank_within_tolerance, diffs, rel_diff



def make_case(shape=(26,), hidden_size=16, vocab=40, vocab_size=None, seed=0):
    """Inputs in float64 (tokens ``shape``, e.g. (T,) or (s, b)) and the two upstream gradients."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(0, vocab_size or vocab, shape, generator=g)
    grads = torch.randn(2, *shape, generator=g, dtype=torch.float64)
    return hidden, weight, targets, grads


def reference(hidden, weight, targets, grads, temperature, vocab_size=None, entropy=True) -> dict:
    """float64 naive values and gradients for upstream grads (grads[0] on logp, grads[1] on entropy)."""
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logp, ent = naive_logprobs(h, w, targets, temperature, vocab_size)
    loss = (logp * grads[0]).sum() + ((ent * grads[1]).sum() if entropy else 0)
    loss.backward()
    return {"logp": logp.detach(), "entropy": ent.detach(), "hidden_grad": h.grad, "weight_grad": w.grad}


def fused(hidden, weight, targets, grads, temperature, dtype, entropy=True, **kwargs) -> dict:
    """The op's values and gradients, on the inputs cast to ``dtype`` (hidden/weight may be shards)."""
    h = hidden.detach().to(dtype, copy=True).requires_grad_()
    w = weight.detach().to(dtype, copy=True).requires_grad_()
    out = vocab_parallel_logprobs(h, w, targets, temperature=temperature, return_entropy=entropy, **kwargs)
    logp, ent = out if entropy else (out, None)
    loss = (logp * grads[0].to(dtype)).sum() + ((ent * grads[1].to(dtype)).sum() if entropy else 0)
    loss.backward()
    result = {"logp": logp.detach(), "hidden_grad": h.grad, "weight_grad": w.grad}
    if entropy:
        result["entropy"] = ent.detach()
    return result


# ---- TP = 1 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 7, 64, None])  # 7 does not divide T=26; 64 > T
def test_tp1_matches_naive(dtype, temperature, chunk_size):
    case = make_case()
    got = fused(*case, temperature, dtype, chunk_size=chunk_size)
    for name, d in diffs(got, reference(*case, temperature)).items():
        assert d <= TOL[dtype], (name, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tp1_logprob_only_and_padded_vocab_and_sbh(dtype):
    # [s, b, H] hidden, Megatron-padded vocabulary (rows 35..39 are padding), no entropy output.
    case = make_case(shape=(5, 3), vocab=40, vocab_size=35, seed=1)
    got = fused(*case, 0.7, dtype, entropy=False, chunk_size=4, vocab_size=35)
    assert got["logp"].shape == (5, 3)
    expected = reference(*case, 0.7, vocab_size=35, entropy=False)
    for name, d in diffs(got, expected).items():
        assert d <= TOL[dtype], (name, d)
    assert got["weight_grad"][35:].abs().max() == 0  # padding rows take no part


def test_tp1_entropy_gradient_alone():
    hidden, weight, targets, grads = make_case(seed=2)
    grads[0] = 0
    h = hidden.clone().requires_grad_()
    _, ent = vocab_parallel_logprobs(h, weight, targets, temperature=0.7, return_entropy=True, chunk_size=5)
    (ent * grads[1]).sum().backward()  # logp unused: its upstream gradient is None inside the op
    assert rel_diff(h.grad, reference(hidden, weight, targets, grads, 0.7)["hidden_grad"]) <= TOL[torch.float64]


def test_tp1_gradcheck_float64():
    hidden, weight, targets, _ = make_case(shape=(5,), hidden_size=4, vocab=7, seed=3)
    h, w = hidden.requires_grad_(), weight.requires_grad_()

    def fn(h, w):
        return vocab_parallel_logprobs(h, w, targets, temperature=0.7, return_entropy=True, chunk_size=2)

    assert torch.autograd.gradcheck(fn, (h, w), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_tp1_bf16_inputs_give_fp32_outputs_and_input_dtype_grads():
    hidden, weight, targets, grads = make_case(seed=4)
    h, w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    logp, ent = vocab_parallel_logprobs(h, w, targets, return_entropy=True, chunk_size=8)
    (logp * grads[0]).sum().backward()
    assert logp.dtype == ent.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.bfloat16
    # Logits from the bf16-rounded inputs in fp32: only the gradients' bf16 rounding remains.
    expected = reference(h.detach().double(), w.detach().double(), targets, grads, 1.0, entropy=False)
    assert rel_diff(logp, expected["logp"]) <= 1e-5
    assert rel_diff(h.grad, expected["hidden_grad"]) <= 1e-2


# ---- memory -----------------------------------------------------------------------------------------------------


class LargestAllocation(TorchDispatchMode):
    """Largest tensor (in elements) any non-aliasing op creates, forward and backward alike."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):  # views and in-place ops reuse memory
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    self.numel = max(self.numel, o.numel())
        return out


def test_no_tokens_x_vocab_tensor_is_saved_or_created():
    T, V, H, chunk = 4096, 8192, 64, 256
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.1).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
        with LargestAllocation() as largest:
            logp, ent = vocab_parallel_logprobs(hidden, weight, targets, return_entropy=True, chunk_size=chunk)
            (logp.sum() + ent.sum()).backward()
    # Saved: hidden, weight, targets (int64) and two fp32 per-token stats; nothing of size T x V.
    assert sum(saved) <= 4 * (T * H + V * H) + 16 * T, sum(saved)
    assert sum(saved) < T * V * 4 / 20
    # Created: chunk x V logit buffers and the V x H weight gradient at most.
    assert largest.numel <= max(chunk * V, V * H), largest.numel


# ---- input validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(weight=torch.zeros(10, 32)), "weight has hidden size 32 but hidden has 8"),
        (dict(targets=torch.zeros(5, dtype=torch.long)), r"targets has shape \(5,\) but hidden \(6, 8\)"),
        (dict(targets=torch.tensor([0, 1, 2, 3, 4, 10])), r"targets must lie in \[0, 10\).*from 0 to 10"),
        (dict(targets=torch.tensor([0, 1, 2, 3, 4, -1])), r"targets must lie in \[0, 10\)"),
        (dict(targets=torch.zeros(6)), "targets must be an integer tensor"),
        (dict(hidden=torch.zeros(8)), "hidden must be a float"),
        (dict(temperature=0.0), "temperature must be a positive"),
        (dict(chunk_size=0), "chunk_size must be a positive int"),
        (dict(vocab_size=11), r"vocab_size must be in \(0, 10\]"),
    ],
)
def test_invalid_inputs_are_named(change, message):
    args = dict(hidden=torch.zeros(6, 8), weight=torch.zeros(10, 8), targets=torch.arange(6))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        vocab_parallel_logprobs(**args)


# ---- TP = 2 (one launch) --------------------------------------------------------------------------------------

TP2_CASES = {
    # name: (token shape, sequence_parallel, temperature, chunk_size, entropy, vocab_size)
    "plain": ((26,), False, 1.0, 7, True, None),
    "temp0.7": ((26,), False, 0.7, 5, True, None),
    "logprob_only": ((26,), False, 0.7, 64, False, None),
    "padded_vocab": ((26,), False, 0.7, 3, True, 33),  # rank 1 owns ids 20..32 plus 7 padding rows
    "sp": ((26,), True, 1.0, 7, True, None),
    "sp_temp0.7": ((26,), True, 0.7, 4, True, None),
    "sp_sbh": ((6, 3), True, 0.7, 5, True, None),  # [s/tp, b, H] per rank
    "sp_logprob_only": ((26,), True, 0.7, 9, False, 37),
}


def tp2_check_all() -> dict:
    """On each of 2 ranks: every TP2 case in fp32 and float64 -> {case/dtype/tensor: rel diff}."""
    from megatron.core import parallel_state as ps

    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    out = {}
    for seed, (name, (shape, sp, temperature, chunk, entropy, vocab_size)) in enumerate(TP2_CASES.items()):
        # Same seed on both ranks: each builds the full problem, then takes its shard.
        hidden, weight, targets, grads = make_case(shape=shape, vocab=40, vocab_size=vocab_size, seed=seed)
        expected = reference(hidden, weight, targets, grads, temperature, vocab_size, entropy)
        rows = slice(rank * 20, (rank + 1) * 20)
        tokens = slice(rank * shape[0] // 2, (rank + 1) * shape[0] // 2) if sp else slice(None)
        expected["weight_grad"] = expected["weight_grad"][rows]
        expected["hidden_grad"] = expected["hidden_grad"][tokens]
        for dtype in (torch.float32, torch.float64):
            got = fused(hidden[tokens], weight[rows], targets, grads, temperature, dtype, entropy, tp_group=group,
                        chunk_size=chunk, sequence_parallel=sp, vocab_size=vocab_size)
            for tensor, d in diffs(got, expected).items():
                out[f"{name}/{str(dtype)[6:]}/{tensor}"] = d
    return out


@pytest.fixture(scope="module")
def tp2_results():
    return run_on_ranks(tp2_check_all, 2, Layout(tensor=2))


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_matches_naive(tp2_results, rank):
    assert_rank_within_tolerance(tp2_results[rank], 2 * 3 * len(TP2_CASES))
