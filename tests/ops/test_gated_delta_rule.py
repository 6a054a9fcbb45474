"""The pure-torch gated delta rule (``ops.gated_delta_rule``, Gated DeltaNet's CPU path) equals the naive recurrence.

Float64 inputs (the op computes in fp32, as fla does): the chunked rule equals the token-by-token loop over 150
tokens (three chunks of 64, the last partial) within 1e-5 relative, its final state too; packed sequences
(``cu_seqlens``: 40, 1 and 109 tokens) equal the sequences run one by one, outputs and gradients, so each starts from
a fresh state; transformers' own torch fallback agrees; the causal convolution restarts at each packed boundary.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.ops.gated_delta_rule import (causal_conv1d, chunk_gated_delta_rule, l2norm,
                                                recurrent_gated_delta_rule)
from tests.ops.common import rel_diff

TOL = 1e-5
B, T, H, K, V = 2, 150, 3, 8, 6
PACKED = [(0, 40), (40, 41), (41, 150)]


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(B, T, H, K, generator=g, dtype=torch.float64)) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    decay = -torch.rand(B, T, H, generator=g, dtype=torch.float64)  # log-space decay, <= 0
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    return q, k, v, decay, beta


def test_chunked_rule_equals_the_recurrence():
    q, k, v, decay, beta = _inputs()
    out, state = chunk_gated_delta_rule(q, k, v, decay, beta, output_final_state=True)
    expected, expected_state = recurrent_gated_delta_rule(q, k, v, decay, beta)
    assert rel_diff(out, expected) <= TOL and rel_diff(state, expected_state) <= TOL


def test_chunked_rule_equals_transformers_fallback():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule

    q, k, v, decay, beta = _inputs(1)
    out = chunk_gated_delta_rule(q, k, v, decay, beta, use_qk_l2norm_in_kernel=True)[0]
    theirs = torch_chunk_gated_delta_rule(*(x.float() for x in (q, k, v, decay, beta)), use_qk_l2norm_in_kernel=True)[0]
    assert rel_diff(out, theirs.double()) <= TOL


def test_packed_sequences_start_from_a_fresh_state():
    q, k, v, decay, beta = (x[:1] for x in _inputs(2))
    q.requires_grad_()
    cu_seqlens = torch.tensor([s for s, _ in PACKED] + [PACKED[-1][1]])
    packed = chunk_gated_delta_rule(q, k, v, decay, beta, cu_seqlens=cu_seqlens)[0]
    (packed_grad,) = torch.autograd.grad(packed.square().sum(), q)
    one_by_one = torch.cat([recurrent_gated_delta_rule(*(x[:, s:e] for x in (q, k, v, decay, beta)))[0]
                            for s, e in PACKED], dim=1)
    (expected_grad,) = torch.autograd.grad(one_by_one.square().sum(), q)
    assert rel_diff(packed, one_by_one.detach()) <= TOL
    assert rel_diff(packed_grad, expected_grad) <= TOL
    whole = chunk_gated_delta_rule(q, k, v, decay, beta)[0]
    assert rel_diff(whole[:, 40:], one_by_one[:, 40:].detach()) > 1e-2, "the state did not matter: a weak check"


def test_causal_conv1d_restarts_at_each_packed_sequence():
    g = torch.Generator().manual_seed(3)
    x, weight = torch.randn(1, 5, 20, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g,
                                                                                      dtype=torch.float64)
    packed = causal_conv1d(x, weight, activation="silu", cu_seqlens=torch.tensor([0, 7, 20]))
    expected = torch.cat([causal_conv1d(x[..., :7], weight, activation="silu"),
                          causal_conv1d(x[..., 7:], weight, activation="silu")], dim=-1)
    assert rel_diff(packed, expected) <= 1e-12
    naive = torch.stack([sum(weight[:, j] * (x[0, :, t - 3 + j] if t - 3 + j >= 0 else 0) for j in range(4))
                         for t in range(7)], dim=-1)
    assert rel_diff(packed[0, :, :7], torch.nn.functional.silu(naive)) <= 1e-12
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, weight, activation="gelu")
