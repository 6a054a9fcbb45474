"""vocab_parallel_sequence_loss equals the same loss on naive full logits -- value, per-token log-probs and
entropies, and the gradients w.r.t. hidden and weight -- and runs three [T, H] x [H, V] matmuls, not four.

The loss is smooth and nonlinear per sequence (an unclipped GSPO-like ratio term, a squared log-prob term and an
entropy bonus), so the per-chunk gradients depend on each sequence's own log-probs, as GSPO's do. Tolerances:
max |a - e| / max |e| per tensor against float64 naive, <= 1e-5 in fp32, <= 1e-12 in float64. TP=2 on two gloo
ranks, with and without sequence parallelism, all cases in one launch; CP=2 (Megatron's load-balanced split, the
GSPO sequence sums all-reduced per chunk) equals the unsplit loss and gradients in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gspo_megatron.ops import vocab_parallel_logprobs, vocab_parallel_sequence_loss
from gspo_megatron.ops.reference import naive_logprobs
from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from tests.ops.common import TOL, assert_rank_within_tolerance, diffs, rel_diff

S, B, H, V = 6, 5, 16, 40


def make_case(s=S, b=B, vocab=V, vocab_size=None, seed=0):
    """float64 hidden [s, b, H], weight [V, H], targets [s, b], and the loss's per-sequence data."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, H, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, H, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(0, vocab_size or vocab, (s, b), generator=g)
    data = {
        "mask": torch.rand(b, s, generator=g) < 0.7,
        "old": -3.0 + 0.1 * torch.randn(b, s, generator=g, dtype=torch.float64),
        "advantages": torch.randn(b, generator=g, dtype=torch.float64),
        "weights": torch.randn(b, s, generator=g, dtype=torch.float64),
    }
    data["mask"][1] = False  # a sequence with no response tokens
    return hidden, weight, targets, data


def make_loss_fn(data: dict, entropy_coef: float, calls: list | None = None):
    def loss_fn(sequences, logp, entropy):
        if calls is not None:
            calls.append(sequences)
        mask = data["mask"][sequences]
        count = mask.sum(-1).clamp_min(1)
        log_ratio = torch.where(mask, logp - data["old"][sequences].to(logp.dtype), 0).sum(-1) / count
        terms = [-data["advantages"][sequences].to(logp.dtype) * torch.exp(log_ratio),
                 0.1 * torch.where(mask, logp, 0) ** 2 * data["weights"][sequences].to(logp.dtype)]
        if entropy is not None:
            terms.append(-entropy_coef * torch.where(mask, entropy, 0).sum(-1) / count)
        loss = sum(t.sum() for t in terms)
        scale = sum(t.detach().abs().sum() for t in terms)  # what the loss's rounding is relative to
        return loss, {"log_ratio": log_ratio.detach(), "tokens": mask.sum(), "scale": scale}

    return loss_fn


def reference(hidden, weight, targets, data, temperature, entropy, vocab_size=None) -> dict:
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logp, ent = naive_logprobs(h, w, targets, temperature, vocab_size)  # [s, b]
    loss, extras = make_loss_fn(data, 0.3)(slice(0, targets.shape[1]), logp.t(), ent.t() if entropy else None)
    loss.backward()
    out = {"loss": loss.detach(), "loss_scale": extras["scale"], "logp": logp.detach().t(), "hidden_grad": h.grad,
           "weight_grad": w.grad, "log_ratio": extras["log_ratio"]}
    if entropy:
        out["entropy"] = ent.detach().t()
    return out


def fused(hidden, weight, targets, data, temperature, entropy, dtype, calls=None, **kwargs) -> dict:
    h = hidden.detach().to(dtype, copy=True).requires_grad_()
    w = weight.detach().to(dtype, copy=True).requires_grad_()
    out = vocab_parallel_sequence_loss(h, w, targets, make_loss_fn(data, 0.3, calls), temperature=temperature,
                                       with_entropy=entropy, **kwargs)
    out.loss.backward()
    result = {"loss": out.loss.detach(), "logp": out.logp, "hidden_grad": h.grad, "weight_grad": w.grad,
              "log_ratio": out.extras["log_ratio"]}
    if entropy:
        result["entropy"] = out.entropy
    assert out.extras["tokens"] == data["mask"].sum()  # scalar extras are summed over chunks
    return result


# ---- TP = 1 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy", [True, False])
# 12: two whole sequences a chunk (5 sequences: the last chunk has one); 6: one; 4 and 5: each sequence in two
# passes over sub-chunks of 4 + 2 or 5 + 1 tokens; None: the auto size (all sequences in one chunk).
@pytest.mark.parametrize("chunk_size", [12, 6, 4, 5, None])
def test_tp1_matches_naive(dtype, temperature, entropy, chunk_size):
    case = make_case()
    calls = []
    got = fused(*case, temperature, entropy, dtype, calls=calls, chunk_size=chunk_size)
    for name, d in diffs(got, reference(*case, temperature, entropy)).items():
        assert d <= TOL[dtype], (name, d)
    per_call = {12: 2, 6: 1, 4: 1, 5: 1, None: B}[chunk_size]
    assert [c.stop - c.start for c in calls] == [min(per_call, B - i) for i in range(0, B, per_call)]


def test_tp1_padded_vocab():
    case = make_case(vocab=40, vocab_size=35, seed=1)
    got = fused(*case, 0.7, True, torch.float64, chunk_size=12, vocab_size=35)
    for name, d in diffs(got, reference(*case, 0.7, True, vocab_size=35)).items():
        assert d <= TOL[torch.float64], (name, d)
    assert got["weight_grad"][35:].abs().max() == 0


def test_tp1_gradcheck_float64():
    hidden, weight, targets, data = make_case(s=3, b=3, seed=2)

    def fn(h, w):
        return vocab_parallel_sequence_loss(h, w, targets, make_loss_fn(data, 0.3), temperature=0.7,
                                            with_entropy=True, chunk_size=6).loss

    assert torch.autograd.gradcheck(fn, (hidden.requires_grad_(), weight.requires_grad_()), eps=1e-6, atol=1e-8)


def test_no_grad_runs_the_loss_without_gradients():
    hidden, weight, targets, data = make_case(seed=3)
    with torch.no_grad():
        out = vocab_parallel_sequence_loss(hidden, weight, targets, make_loss_fn(data, 0.3), chunk_size=12)
    assert not out.loss.requires_grad
    assert rel_diff(out.loss, reference(hidden, weight, targets, data, 1.0, False)["loss"]) <= 1e-12


class MatmulVocabFlops(TorchDispatchMode):
    """Multiply-adds of the matmuls that touch the vocabulary dimension (the logits and their gradients)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.macs, self.largest = vocab, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default,
                    torch.ops.aten.addmm_.default, torch.ops.aten.addmm.out):
            a, b = (args[0], args[1]) if "mm." in str(func) and "addmm" not in str(func) else (args[1], args[2])
            if self.vocab in (a.shape[0], a.shape[1], b.shape[1]):
                self.macs += a.shape[0] * a.shape[1] * b.shape[1]
        if not any(r.alias_info is not None for r in func._schema.returns):
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    self.largest = max(self.largest, o.numel())
        return out


def test_three_vocab_matmuls_not_four_and_no_tokens_x_vocab_tensor():
    s, b, vocab, hidden_size = 64, 32, 4096, 32
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(s, b, hidden_size, generator=g).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) * 0.1).requires_grad_()
    targets = torch.randint(0, vocab, (s, b), generator=g)
    data = {"mask": torch.ones(b, s, dtype=torch.bool), "old": torch.zeros(b, s), "advantages": torch.ones(b),
            "weights": torch.zeros(b, s)}
    one_gemm = s * b * hidden_size * vocab
    with MatmulVocabFlops(vocab) as fused_count:
        vocab_parallel_sequence_loss(hidden, weight, targets, make_loss_fn(data, 0.0), chunk_size=256).loss.backward()
    with MatmulVocabFlops(vocab) as op_count:
        vocab_parallel_logprobs(hidden, weight, targets, chunk_size=256).sum().backward()
    assert fused_count.macs == 3 * one_gemm and op_count.macs == 4 * one_gemm, (fused_count.macs, op_count.macs)
    assert fused_count.largest <= max(256 * vocab, vocab * hidden_size), fused_count.largest


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(hidden=torch.zeros(6, 8)), ValueError, r"hidden must be \[s, b, H\]"),
        (dict(targets=torch.zeros(2, 3, dtype=torch.long)), ValueError, r"targets has shape \(2, 3\)"),
        (dict(loss_fn=None), TypeError, "loss_fn must be callable"),
        (dict(loss_fn=lambda s, lp, e: (lp.sum(-1), {})), ValueError, "loss_fn must return"),
    ],
)
def test_invalid_inputs_are_named(kwargs, error, message):
    args = dict(hidden=torch.zeros(3, 2, 8), weight=torch.zeros(10, 8), targets=torch.zeros(3, 2, dtype=torch.long),
                loss_fn=lambda s, lp, e: (lp.sum(), {}))
    args.update(kwargs)
    with pytest.raises(error, match=message):
        vocab_parallel_sequence_loss(**args)


# ---- TP = 2 (one launch) --------------------------------------------------------------------------------------

TP2_CASES = {
    # name: (sequence_parallel, temperature, chunk_size, entropy, vocab_size)
    "plain": (False, 1.0, 12, True, None),
    "two_pass_temp0.7": (False, 0.7, 4, True, None),
    "logprob_only": (False, 0.7, 12, False, None),
    "two_pass_logprob_only": (False, 0.7, 5, False, 33),  # rank 1 owns ids 20..32 plus 7 padding rows
    "sp": (True, 0.7, 6, True, None),
    "sp_logprob_only": (True, 1.0, 30, False, 37),
    "sp_two_pass": (True, 0.7, 4, False, None),
}


def tp2_check_all() -> dict:
    from megatron.core import parallel_state as ps

    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    out = {}
    for seed, (name, (sp, temperature, chunk, entropy, vocab_size)) in enumerate(TP2_CASES.items()):
        hidden, weight, targets, data = make_case(vocab_size=vocab_size, seed=seed)
        expected = reference(hidden, weight, targets, data, temperature, entropy, vocab_size)
        rows = slice(rank * V // 2, (rank + 1) * V // 2)
        positions = slice(rank * S // 2, (rank + 1) * S // 2) if sp else slice(None)
        expected["weight_grad"] = expected["weight_grad"][rows]
        expected["hidden_grad"] = expected["hidden_grad"][positions]
        for dtype in (torch.float32, torch.float64):
            got = fused(hidden[positions], weight[rows], targets, data, temperature, entropy, dtype, tp_group=group,
                        chunk_size=chunk, sequence_parallel=sp, vocab_size=vocab_size)
            for tensor, d in diffs(got, expected).items():
                out[f"{name}/{str(dtype)[6:]}/{tensor}"] = d
    return out


@pytest.fixture(scope="module")
def tp2_results():
    return run_on_ranks(tp2_check_all, 2, Layout(tensor=2))


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_matches_naive(tp2_results, rank):
    assert_rank_within_tolerance(tp2_results[rank], 2 * 5 * len(TP2_CASES))


# ---- CP = 2: the GSPO loss with its sequence sums reduced over context-parallel ranks, chunk by chunk -----------


def _gspo_cp_loss_fn(data: dict, index: torch.Tensor, group):
    from gspo_megatron.algo import gspo_loss_from_sums, masked_log_ratio_sums
    from gspo_megatron.parallel.reductions import all_reduce_sequence_sums

    def loss_fn(sequences, logp, entropy):
        mask = data["mask"][sequences][:, index]
        sums, counts = masked_log_ratio_sums(logp, data["old"][sequences][:, index].to(logp.dtype), mask)
        sums, counts = all_reduce_sequence_sums(sums, counts, group)
        terms = gspo_loss_from_sums(sums, counts, data["advantages"][sequences].to(logp.dtype), eps_low=0.2,
                                    eps_high=0.2, num_sequences=1.0)
        return terms.loss, {"seq_log_ratio": terms.seq_log_ratio.detach()}

    return loss_fn


def _cp_case(s: int):
    """A case whose old log-probs are the model's own plus 1e-2 noise: ratios near 1, none clipped at eps 0.2."""
    hidden, weight, targets, data = make_case(s=s, seed=7)
    noise = 1e-2 * torch.randn(data["old"].shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    data["old"] = naive_logprobs(hidden, weight, targets)[0].t() + noise
    return hidden, weight, targets, data


def cp2_check() -> dict:
    """Each CP rank holds Megatron's load-balanced half of every sequence (chunks r and 3 - r of 4)."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.parallel.context import token_index

    group, rank = ps.get_context_parallel_group(), ps.get_context_parallel_rank()
    s = 8
    hidden, weight, targets, data = _cp_case(s)
    index = token_index(s, 2, rank)  # the model path's split (train.update.batch.batch_for_model)
    out = {"index": index}
    for chunk in (8, 3):  # one sequence a chunk (one pass), and two passes per sequence
        h = hidden[index].detach().clone().requires_grad_()  # float64: the split is exact, not merely close
        w = weight.detach().clone().requires_grad_()
        res = vocab_parallel_sequence_loss(h, w, targets[index], _gspo_cp_loss_fn(data, index, group),
                                           chunk_size=chunk)
        res.loss.backward()
        out[chunk] = {"loss": res.loss.detach(), "seq_log_ratio": res.extras["seq_log_ratio"],
                      "hidden_grad": h.grad, "weight_grad": w.grad}
    return out


def test_cp2_gspo_equals_unsplit():
    from gspo_megatron.algo import gspo_loss_from_sums, masked_log_ratio_sums

    results = run_on_ranks(cp2_check, 2, Layout(context=2))
    hidden, weight, targets, data = _cp_case(8)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, _ = naive_logprobs(h, w, targets)
    terms = gspo_loss_from_sums(*masked_log_ratio_sums(logp.t(), data["old"], data["mask"]), data["advantages"],
                                eps_low=0.2, eps_high=0.2, num_sequences=1.0)
    terms.loss.backward()
    assert not (terms.clipped_low | terms.clipped_high).any()
    for chunk in (8, 3):
        hidden_grad = torch.zeros_like(hidden)
        weight_grad = torch.zeros_like(weight)
        for r in results:
            got = r[chunk]
            assert rel_diff(got["loss"], terms.loss.detach()) <= 1e-12  # every CP rank has the whole loss
            assert rel_diff(got["seq_log_ratio"], terms.seq_log_ratio.detach()) <= 1e-12
            hidden_grad[r["index"]] += got["hidden_grad"].double()
            weight_grad += got["weight_grad"].double()  # the DP x CP gradient reduction sums these
        assert rel_diff(hidden_grad, h.grad) <= 1e-12 and rel_diff(weight_grad, w.grad) <= 1e-12, chunk
