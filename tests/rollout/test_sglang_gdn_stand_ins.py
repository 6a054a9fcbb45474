"""patches/sglang_cpu's pure-torch stand-ins for the Triton kernels SGLang runs for the gated-DeltaNet hybrids
(``_gspo_gated_deltanet``) equal transformers' torch references (Qwen3-Next's ``torch_causal_conv1d_update``,
``torch_recurrent_gated_delta_rule``, ``Qwen3NextRMSNormGated``) and the kernels' own index arithmetic, with SGLang's
conventions: states in pools indexed per request (padding rows skipped and left alone, the other slots untouched),
varlen prefills from initial states, more value heads than key heads. fp32 inputs; the chunked prefill rule is
compared with the token-by-token reference (``STATE_TOL``). No server: the whole path is
tests/train/test_family_loop.py (the CLI loop on a launched server)."""

from __future__ import annotations


import pytest
import torch

from .helpers import import_from_cpu_site

modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

TOL = 1e-6  # one formula, another order of operations
STATE_TOL = 2e-5  # chunks of 64 (the WY form) against the token-by-token rule, fp32
H, HV, K, V = 2, 4, 8, 6  # two value heads per key head (Qwen3.5's grouped values)
SLOTS = 6


@pytest.fixture(scope="module")
def gdn():
    return import_from_cpu_site("_gspo_gated_deltanet")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _conv_case(g, dim=10, width=4):
    weight, bias = torch.randn(dim, width, generator=g), torch.randn(dim, generator=g)
    pool = torch.randn(SLOTS, dim, width - 1, generator=g)
    return weight, bias, pool


def _conv_reference(x, state, weight, bias):
    """transformers' causal_conv1d_update on one sequence x [dim, L] from state [dim, width - 1] (zeros for a fresh
    sequence): (out [dim, L], new state)."""
    state = state.clone()[None]
    out = modeling.causal_conv1d_update.__wrapped__(x[None], state, weight, bias, "silu") \
        if hasattr(modeling.causal_conv1d_update, "__wrapped__") else \
        modeling.causal_conv1d_update(x[None], state, weight, bias, "silu")
    return out[0], state[0]


def test_prefill_convolution_continues_each_slot_where_it_has_a_state(gdn):
    g = _gen()
    weight, bias, pool = _conv_case(g)
    lengths, slots, initial = [5, 1, 9, 2], [3, 0, 5, -1], [True, False, True, False]  # the last row is padding
    x = torch.randn(10, sum(lengths), generator=g)
    start = torch.tensor([0] + lengths).cumsum(0)
    before = pool.clone()
    out = gdn.causal_conv1d_fn(x, weight, bias, pool, start.int(), lengths, torch.tensor(slots).int(),
                               torch.tensor(initial), activation="silu")
    for n, (s, e) in enumerate(zip(start[:-1].tolist(), start[1:].tolist())):
        if slots[n] < 0:
            assert out[:, s:e].abs().max() == 0
            continue
        state = before[slots[n]] if initial[n] else torch.zeros_like(before[0])
        ref_out, ref_state = _conv_reference(x[:, s:e], state, weight, bias)
        torch.testing.assert_close(out[:, s:e], ref_out, rtol=0, atol=TOL)
        torch.testing.assert_close(pool[slots[n]], ref_state, rtol=0, atol=0)
    for untouched in (1, 2, 4):
        assert torch.equal(pool[untouched], before[untouched])


def test_decode_convolution_updates_each_rows_slot(gdn):
    g = _gen(1)
    weight, bias, pool = _conv_case(g)
    slots = [4, -1, 1]
    x = torch.randn(3, 10, generator=g)
    before = pool.clone()
    out = gdn.causal_conv1d_update(x, pool, weight, bias, "silu", conv_state_indices=torch.tensor(slots).int())
    for row, slot in enumerate(slots):
        if slot < 0:
            assert out[row].abs().max() == 0
            continue
        ref_out, ref_state = _conv_reference(x[row][:, None], before[slot], weight, bias)
        torch.testing.assert_close(out[row], ref_out[:, 0], rtol=0, atol=TOL)
        torch.testing.assert_close(pool[slot], ref_state, rtol=0, atol=0)
    for untouched in (0, 2, 3, 5):
        assert torch.equal(pool[untouched], before[untouched])


def _gates(g, tokens):
    A_log, dt_bias = torch.randn(HV, generator=g) * 0.5, torch.randn(HV, generator=g)
    a, b = torch.randn(tokens, HV, generator=g) * 3, torch.randn(tokens, HV, generator=g)
    a[0, 0] = 30.0  # beyond softplus's threshold (20): linear there
    return A_log, dt_bias, a, b


def test_gates_are_the_decay_and_write_strength(gdn):
    A_log, dt_bias, a, b = _gates(_gen(2), 7)
    decay, beta = gdn.fused_gdn_gating(A_log, a, b, dt_bias)
    x = a + dt_bias
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    torch.testing.assert_close(decay, (-torch.exp(A_log) * softplus)[None], rtol=0, atol=TOL)
    torch.testing.assert_close(beta, torch.sigmoid(b)[None], rtol=0, atol=0)
    assert decay.shape == (1, 7, HV) and decay.dtype == beta.dtype == torch.float32


def _rule_reference(q, k, v, decay, beta, state):
    """transformers' token-by-token rule on one sequence ([T, H|HV, .]) from an SGLang-layout state [HV, V, K]:
    (out [T, HV, V], the new state in SGLang's layout)."""
    q, k = (x.repeat_interleave(HV // H, dim=1) for x in (q, k))
    out, final = modeling.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], decay[None], beta[None], initial_state=state.transpose(-1, -2)[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0].transpose(-1, -2)


def test_prefill_rule_runs_each_sequence_from_its_slot(gdn):
    """Varlen: 40, 1 and 70 tokens (two chunks of 64, the second partial) from three slots' states."""
    g = _gen(3)
    lengths, slots = [40, 1, 70], [4, 1, 2]
    T = sum(lengths)
    q, k = torch.randn(1, T, H, K, generator=g), torch.randn(1, T, H, K, generator=g)
    v = torch.randn(1, T, HV, V, generator=g)
    A_log, dt_bias, a, b = _gates(g, T)
    decay, beta = gdn.fused_gdn_gating(A_log, a, b, dt_bias)
    pool = torch.randn(SLOTS, HV, V, K, generator=g) * 0.3
    before = pool.clone()
    cu = torch.tensor([0] + lengths).cumsum(0)
    out, _, _ = gdn.chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=pool,
                                           initial_state_indices=torch.tensor(slots).int(), cu_seqlens=cu,
                                           use_qk_l2norm_in_kernel=True)
    assert out.shape == (1, T, HV, V)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ref_out, ref_state = _rule_reference(q[0, s:e], k[0, s:e], v[0, s:e], decay[0, s:e], beta[0, s:e],
                                             before[slots[n]])
        torch.testing.assert_close(out[0, s:e], ref_out, rtol=0, atol=STATE_TOL)
        torch.testing.assert_close(pool[slots[n]], ref_state, rtol=0, atol=STATE_TOL)
    for untouched in (0, 3, 5):
        assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("packed", [False, True])
def test_decode_rule_steps_each_rows_slot(gdn, packed):
    """One token per request, gates in the kernel: ``fused_sigmoid_gating_delta_rule_update`` (q, k, v split) and
    the packed decode (``fused_recurrent_gated_delta_rule_packed_decode``, one [q | k | v] row per request)."""
    g = _gen(4)
    slots = [3, -1, 0]
    B = len(slots)
    q, k = torch.randn(1, B, H, K, generator=g), torch.randn(1, B, H, K, generator=g)
    v = torch.randn(1, B, HV, V, generator=g)
    A_log, dt_bias, a, b = _gates(g, B)
    pool = torch.randn(SLOTS, HV, V, K, generator=g) * 0.3
    before = pool.clone()
    indices = torch.tensor(slots).int()
    if packed:
        mixed = torch.cat([q[0].reshape(B, -1), k[0].reshape(B, -1), v[0].reshape(B, -1)], dim=-1)
        out = torch.empty(B, 1, HV, V)
        gdn.fused_recurrent_gated_delta_rule_packed_decode(mixed, a, b, A_log, dt_bias, K ** -0.5, pool, out,
                                                           indices, use_qk_l2norm_in_kernel=True)
        out = out.transpose(0, 1)
    else:
        out = gdn.fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, 1.0, 20.0, q, k, v, b, pool, indices,
                                                         use_qk_l2norm_in_kernel=True,
                                                         cu_seqlens=torch.arange(B + 1).int())
    decay, beta = gdn.fused_gdn_gating(A_log, a, b, dt_bias)
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        ref_out, ref_state = _rule_reference(q[0, row:row + 1], k[0, row:row + 1], v[0, row:row + 1],
                                             decay[0, row:row + 1], beta[0, row:row + 1], before[slot])
        torch.testing.assert_close(out[0, row], ref_out[0], rtol=0, atol=TOL)
        torch.testing.assert_close(pool[slot], ref_state, rtol=0, atol=TOL)
    for untouched in (1, 2, 4, 5):
        assert torch.equal(pool[untouched], before[untouched])


def test_output_norm_is_transformers_gated_rms_norm(gdn):
    g = _gen(5)
    norm = modeling.Qwen3NextRMSNormGated(V, eps=1e-6)
    norm.weight.data = torch.randn(V, generator=g)
    x, z = torch.randn(9, V, generator=g), torch.randn(9, V, generator=g)
    out = gdn.rms_norm_gated(x, norm.weight, None, z, 1e-6, None, True, "swish")
    torch.testing.assert_close(out, norm(x, z), rtol=0, atol=TOL)


def _split_reference(mixed_qkvz, mixed_ba, interleaved):
    """The split kernels' index arithmetic (triton_gdn_fused_proj.py), one element at a time."""
    T, per = mixed_qkvz.shape[0], HV // H
    mixed_qkv, z = torch.empty(T, 2 * H * K + HV * V), torch.empty(T, HV, V)
    b, a = torch.empty(T, HV), torch.empty(T, HV)
    group = 2 * K + 2 * per * V
    for t in range(T):
        for i in range(H):
            if interleaved:  # [q k v z] per key-head group
                base = i * group
                q, k = mixed_qkvz[t, base:base + K], mixed_qkvz[t, base + K:base + 2 * K]
                vv = mixed_qkvz[t, base + 2 * K:base + 2 * K + per * V]
                zz = mixed_qkvz[t, base + 2 * K + per * V:base + group]
                bb, aa = mixed_ba[t, i * 2 * per:i * 2 * per + per], mixed_ba[t, i * 2 * per + per:(i + 1) * 2 * per]
            else:  # [all q | all k | all v | all z], [all b | all a]
                q, k = mixed_qkvz[t, i * K:(i + 1) * K], mixed_qkvz[t, H * K + i * K:H * K + (i + 1) * K]
                vv = mixed_qkvz[t, 2 * H * K + i * per * V:2 * H * K + (i + 1) * per * V]
                zz = mixed_qkvz[t, 2 * H * K + HV * V + i * per * V:2 * H * K + HV * V + (i + 1) * per * V]
                bb, aa = mixed_ba[t, i * per:(i + 1) * per], mixed_ba[t, HV + i * per:HV + (i + 1) * per]
            mixed_qkv[t, i * K:(i + 1) * K], mixed_qkv[t, H * K + i * K:H * K + (i + 1) * K] = q, k
            mixed_qkv[t, 2 * H * K + i * per * V:2 * H * K + (i + 1) * per * V] = vv
            z[t, i * per:(i + 1) * per] = zz.reshape(per, V)
            b[t, i * per:(i + 1) * per], a[t, i * per:(i + 1) * per] = bb, aa
    return mixed_qkv, z, b, a


@pytest.mark.parametrize("interleaved", [True, False])  # Qwen3-Next's projections, Qwen3.5's
def test_projection_splits_follow_the_kernels_layout(gdn, interleaved):
    g = _gen(6)
    mixed_qkvz, mixed_ba = torch.randn(3, 2 * H * K + 2 * HV * V, generator=g), torch.randn(3, 2 * HV, generator=g)
    split = gdn.fused_qkvzba_split_reshape_cat if interleaved else gdn.fused_qkvzba_split_reshape_cat_contiguous
    for got, want in zip(split(mixed_qkvz, mixed_ba, H, HV, K, V), _split_reference(mixed_qkvz, mixed_ba, interleaved)):
        assert torch.equal(got, want)


def test_attention_and_shared_expert_gates(gdn):
    g = _gen(7)
    attn, gate = torch.randn(5, 3 * 4, generator=g), torch.randn(5, 3, 8, generator=g)[..., :4]  # a strided view
    torch.testing.assert_close(gdn.fused_sigmoid_mul(attn, gate), attn * torch.sigmoid(gate.reshape(5, 12)),
                               rtol=0, atol=TOL)
    hidden, weight, shared = torch.randn(5, 16, generator=g), torch.randn(16, generator=g), torch.randn(5, 16, generator=g)
    routed = torch.randn(5, 16, generator=g)
    expected = routed + torch.sigmoid(hidden @ weight)[:, None] * shared
    gdn.launch_fused_gate_sigmoid_mul(hidden, weight, shared, routed, do_add=True)
    torch.testing.assert_close(routed, expected, rtol=0, atol=TOL)
