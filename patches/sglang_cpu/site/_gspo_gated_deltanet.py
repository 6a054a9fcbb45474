"""Pure-torch stand-ins for the Triton kernels SGLang 0.5.23 runs for the gated-DeltaNet hybrids (Qwen3.5,
Qwen3-Next), so that a CPU server serves them.

Our CPU server runs without ``SGLANG_USE_CPU_ENGINE`` (its sgl-kernel CPU build, which has
``chunk_gated_delta_rule_cpu`` and friends, is not on PyPI), so SGLang takes its GPU path: Triton kernels, which
need a GPU (under ``TRITON_INTERPRET=1`` the convolution kernel fails: "mask has unsupported dtype"). Each function
here has the signature and the state semantics of the kernel it replaces (``install`` binds it where sglang
defines that kernel, before the GDN backend and the models import it):

- states live in pools indexed per request (``cache_indices`` / ``initial_state_indices``; ``PAD_SLOT_ID`` rows
  are skipped): the convolution's last ``width - 1`` inputs [slots, dim, width - 1] and the recurrent state
  [slots, HV, V, K] (SGLang's layout: transposed from fla's [K, V]), updated in place;
- a prefill batch is varlen (``query_start_loc`` / ``cu_seqlens``): each sequence starts from its slot's state
  (the convolution's only where ``has_initial_state``), as SGLang's kernels do;
- the value heads outnumber the key heads by an integer factor (Qwen3.5: grouped value attention): key head
  ``i // (HV // H)`` serves value head ``i``.

The rule itself is ``gspo_megatron.ops.gated_delta_rule`` (the trainer's CPU path, tested against the naive
recurrence): chunks of 64 for a prefill, the token-by-token step for a decode. What SGLang adds and these do not:
speculative decoding's verify paths, ReplaySSM, the radix cache's per-chunk state snapshots (launched CPU servers of
these families run with ``--disable-radix-cache``; ``server.launch_command``) and FP8 outputs: they raise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAD_SLOT_ID = -1


def _unsupported(name: str, what: str):
    raise NotImplementedError(f"patches/sglang_cpu: the pure-torch {name} does not support {what} (CPU serving of "
                              "the gated-DeltaNet hybrids runs without speculative decoding and the radix cache)")


def _activate(x: torch.Tensor, activation) -> torch.Tensor:
    if activation in (True, "silu", "swish"):
        return F.silu(x)
    if activation in (None, False):
        return x
    raise ValueError(f"causal_conv1d: activation {activation!r} (silu, swish or None)")


def _convolve(window: torch.Tensor, weight: torch.Tensor, bias, activation) -> torch.Tensor:
    """[B, dim, width - 1 + L] (the state, then L new inputs) -> [B, dim, L]: the depthwise causal convolution."""
    out = torch.einsum("bdlw,dw->bdl", window.unfold(-1, weight.shape[1], 1).float(), weight.float())
    if bias is not None:
        out = out + bias.float()[:, None]
    return _activate(out, activation)


def _check_state_len(conv_states: torch.Tensor, width: int) -> int:
    if conv_states.shape[-1] != width - 1:
        raise ValueError(f"patches/sglang_cpu causal_conv1d: a conv state of {conv_states.shape[-1]} inputs for a "
                         f"kernel of width {width} (the stand-in keeps exactly width - 1)")
    return width - 1


def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, seq_lens_cpu=None, cache_indices=None,
                     has_initial_state=None, activation="silu", pad_slot_id=PAD_SLOT_ID, validate_data=False,
                     block_table=None, **unused):
    """A prefill's convolution: x [dim, tokens] (sequences packed by ``query_start_loc``) -> [dim, tokens]. Each
    sequence continues from ``conv_states[cache_indices[i]]`` where ``has_initial_state[i]`` (else from zeros), and
    its last ``width - 1`` inputs are written back there."""
    dim, width = weight.shape
    out = torch.zeros_like(x)
    state_len = _check_state_len(conv_states, width) if conv_states is not None else width - 1
    bounds = query_start_loc.tolist()
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        slot = int(cache_indices[i]) if cache_indices is not None else i
        if slot == pad_slot_id or end <= start:
            continue
        initial = (conv_states is not None and has_initial_state is not None and bool(has_initial_state[i]))
        prior = conv_states[slot].to(x.dtype) if initial else x.new_zeros(dim, state_len)
        window = torch.cat([prior, x[:, start:end]], dim=-1)
        out[:, start:end] = _convolve(window[None], weight, bias, activation)[0].to(x.dtype)
        if conv_states is not None:
            conv_states[slot] = window[:, -state_len:].to(conv_states.dtype)
    return out


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, num_accept_tokens=None, intermediate_conv_window=None,
                         intermediate_state_indices=None, retrieve_next_token=None, retrieve_next_sibling=None,
                         retrieve_parent_token=None, pad_slot_id=PAD_SLOT_ID, metadata=None, validate_data=False):
    """A decode's convolution: x [B, dim] (or [B, dim, L]) continues each row's ``conv_state`` (row
    ``conv_state_indices[b]``), which then holds the last ``width - 1`` inputs. Padding rows stay zero."""
    if cache_seqlens is not None or num_accept_tokens is not None or intermediate_conv_window is not None \
            or retrieve_parent_token is not None:
        _unsupported("causal_conv1d_update", "circular states or speculative verification")
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    state_len = _check_state_len(conv_state, weight.shape[1])
    slots = (conv_state_indices.long() if conv_state_indices is not None
             else torch.arange(x.shape[0], device=x.device))
    valid = slots != pad_slot_id
    out = torch.zeros_like(x)
    if bool(valid.any()):
        rows, used = valid.nonzero(as_tuple=True)[0], slots[valid]
        window = torch.cat([conv_state[used].to(x.dtype), x[rows]], dim=-1)
        out[rows] = _convolve(window, weight, bias, activation).to(x.dtype)
        conv_state[used] = window[..., -state_len:].to(conv_state.dtype)
    return out.squeeze(-1) if squeeze else out


def fused_gdn_gating(A_log, a, b, dt_bias, beta=1.0, threshold=20.0):
    """The decay and the write strength of each token and value head: a, b [T, HV] -> g = -exp(A_log) *
    softplus(a + dt_bias), beta = sigmoid(b), each [1, T, HV] fp32."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=beta, threshold=threshold)
    return g.unsqueeze(0), torch.sigmoid(b.float()).unsqueeze(0)


def _value_heads(x: torch.Tensor, value_heads: int) -> torch.Tensor:
    """q or k [.., H, K] -> [.., HV, K]: key head i // (HV // H) for value head i."""
    return x if x.shape[-2] == value_heads else x.repeat_interleave(value_heads // x.shape[-2], dim=-2)


def _states(pool: torch.Tensor, indices: torch.Tensor, count: int):
    """(fla-layout states [count, HV, K, V] fp32 read from ``pool``'s rows ``indices`` (zero for padding rows),
    the mask of the rows that are not padding)."""
    heads, v_dim, k_dim = pool.shape[-3:]
    states = pool.new_zeros(count, heads, k_dim, v_dim, dtype=torch.float32)
    valid = indices.long() >= 0
    if bool(valid.any()):
        states[valid] = pool[indices.long()[valid]].float().transpose(-1, -2)
    return states, valid


def _write_states(pool: torch.Tensor, indices: torch.Tensor, valid: torch.Tensor, states: torch.Tensor) -> None:
    if bool(valid.any()):
        pool[indices.long()[valid]] = states[valid].transpose(-1, -2).to(pool.dtype)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, initial_state_indices=None,
                           cu_seqlens=None, head_first=False, use_qk_l2norm_in_kernel=False, inplace_update=True):
    """A prefill's rule: q, k [1, T, H, K]; v [1, T, HV, V]; g, beta [1, T, HV]; sequences packed by
    ``cu_seqlens``, each from its slot of ``initial_state`` ([slots, HV, V, K], rows ``initial_state_indices``),
    written back there (``inplace_update``). Returns (o [1, T, HV, V], None, None): the per-chunk states SGLang's
    radix cache snapshots are not kept."""
    from gspo_megatron.ops import gated_delta_rule as rule

    if head_first:
        _unsupported("chunk_gated_delta_rule", "head_first")
    heads = v.shape[-2]
    if use_qk_l2norm_in_kernel:
        q, k = rule.l2norm(q.float()), rule.l2norm(k.float())
    q, k = _value_heads(q, heads), _value_heads(k, heads)
    count = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    if initial_state_indices is None:
        initial_state_indices = torch.arange(count, device=q.device)
    states, valid = _states(initial_state, initial_state_indices, count)
    out, final = rule.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=states,
                                             output_final_state=True, cu_seqlens=cu_seqlens)
    if inplace_update:
        _write_states(initial_state, initial_state_indices, valid, final)
    return out.to(v.dtype), None, None


def _recurrent(q, k, v, g, beta, scale, use_qk_l2norm, pool, indices, cu_seqlens, update_state=True):
    """The rule token by token over sequences packed by ``cu_seqlens`` (or the rows of q), from and back to their
    pool slots: q, k [B, T, H, K], v [B, T, HV, V], g, beta [B, T, HV] -> o [B, T, HV, V]."""
    from gspo_megatron.ops import gated_delta_rule as rule

    heads = v.shape[-2]
    if use_qk_l2norm:
        q, k = rule.l2norm(q.float()), rule.l2norm(k.float())
    q, k = _value_heads(q, heads), _value_heads(k, heads)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is not None:  # packed: [1, T, ...] -> one row per sequence (decode: one token each)
        lengths = cu_seqlens.diff().tolist()
        if len(set(lengths)) > 1:
            out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
            bounds = cu_seqlens.tolist()
            for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
                out[:, s:e] = _recurrent(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale, False,
                                         pool, indices[i:i + 1], None, update_state)
            return out
        rows, length = len(lengths), lengths[0] if lengths else 0
        q, k, v, g, beta = (x.reshape(rows, length, *x.shape[2:]) for x in (q, k, v, g, beta))
        return _recurrent(q, k, v, g, beta, scale, False, pool, indices, None, update_state).reshape(
            1, rows * length, *v.shape[2:])
    states, valid = _states(pool, indices, q.shape[0])
    out, final = rule.recurrent_gated_delta_rule(q, k, v.float(), g, beta, scale=scale, initial_state=states)
    if update_state:
        _write_states(pool, indices, valid, final)
    return out.to(v.dtype)


def _decode_gates(A_log, a, dt_bias, b, softplus_beta=1.0, softplus_threshold=20.0):
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=softplus_beta,
                                          threshold=softplus_threshold)
    return g, torch.sigmoid(b.float())


def fused_sigmoid_gating_delta_rule_update(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b,
                                           initial_state_source, initial_state_indices, scale=None,
                                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, is_kda=False,
                                           lower_bound=None, disable_state_update=False,
                                           intermediate_states_buffer=None, intermediate_state_indices=None,
                                           cache_steps=None, retrieve_parent_token=None, cache_ring=False,
                                           replayssm_rawv=None, replayssm_rawk=None, replayssm_g=None,
                                           replayssm_beta=None, match_cutedsl_decode=False):
    """A decode's rule with its gates: q, k [B, T, H, K], v [B, T, HV, V], a, b [tokens, HV] -> o [B, T, HV, V];
    the state of each sequence (``cu_seqlens``) read from and written back to ``initial_state_source``."""
    if is_kda or lower_bound is not None or intermediate_states_buffer is not None or cache_ring \
            or retrieve_parent_token is not None or match_cutedsl_decode:
        _unsupported("fused_sigmoid_gating_delta_rule_update", "KDA, speculative verification or ReplaySSM")
    g, beta = _decode_gates(A_log, a, dt_bias, b, softplus_beta, softplus_threshold)
    g, beta = g.reshape(v.shape[:-1]), beta.reshape(v.shape[:-1])
    return _recurrent(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, initial_state_source,
                      initial_state_indices, cu_seqlens, update_state=not disable_state_update)


def fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                                                   ssm_state_indices, use_qk_l2norm_in_kernel=False):
    """The packed decode: mixed_qkv [B, q | k | v] (after the convolution), a, b [B, HV]; writes o into ``out``
    [B, 1, HV, V] and each row's state into ``initial_state[ssm_state_indices[b]]``."""
    heads, v_dim, k_dim = initial_state.shape[-3:]
    rows = mixed_qkv.shape[0]
    q_dim = (mixed_qkv.shape[1] - heads * v_dim) // 2
    q, k, v = mixed_qkv.split([q_dim, q_dim, heads * v_dim], dim=-1)
    q, k = q.reshape(rows, 1, q_dim // k_dim, k_dim), k.reshape(rows, 1, q_dim // k_dim, k_dim)
    g, beta = _decode_gates(A_log, a, dt_bias, b)
    o = _recurrent(q, k, v.reshape(rows, 1, heads, v_dim), g[:, None], beta[:, None], scale,
                   use_qk_l2norm_in_kernel, initial_state, ssm_state_indices, None)
    out.copy_(o)
    return out, initial_state


def rms_norm_gated(x, weight, bias, z, eps, group_size, norm_before_gate, activation):
    """The DeltaNet's output norm: RMS-normalise x (per group of ``group_size``) in fp32, scale by weight (+ bias),
    gate by act(z) after the norm (``norm_before_gate``) or before it."""
    act = {"swish": F.silu, "silu": F.silu, "sigmoid": torch.sigmoid}[activation]
    shape, dtype = x.shape, x.dtype
    x = x.float()
    if z is not None and not norm_before_gate:
        x = x * act(z.float())
    groups = x.reshape(*shape[:-1], -1, group_size or shape[-1])
    x = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + eps)).reshape(shape)
    x = x * weight.float() + (bias.float() if bias is not None else 0.0)
    if z is not None and norm_before_gate:
        x = x * act(z.float())
    return x.to(dtype)


def fused_qkvzba_split_reshape_cat(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """Qwen3-Next's interleaved projections, per key-head group [q | k | v | z] and [b | a] -> (mixed_qkv
    [T, all q | all k | all v], z [T, HV, V], b, a [T, HV])."""
    tokens, per_group = mixed_qkvz.shape[0], num_heads_v // num_heads_qk
    groups = mixed_qkvz.reshape(tokens, num_heads_qk, -1)
    q, k, v, z = groups.split([head_qk, head_qk, per_group * head_v, per_group * head_v], dim=-1)
    b, a = mixed_ba.reshape(tokens, num_heads_qk, 2 * per_group).split([per_group, per_group], dim=-1)
    mixed_qkv = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
    return (mixed_qkv, z.reshape(tokens, num_heads_v, head_v).contiguous(),
            b.reshape(tokens, num_heads_v).contiguous(), a.reshape(tokens, num_heads_v).contiguous())


def fused_qkvzba_split_reshape_cat_contiguous(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """Qwen3.5's projections [all q | all k | all v | all z] and [all b | all a] -> the same outputs."""
    tokens, qkv_dim = mixed_qkvz.shape[0], 2 * num_heads_qk * head_qk + num_heads_v * head_v
    return (mixed_qkvz[:, :qkv_dim].contiguous(),
            mixed_qkvz[:, qkv_dim:qkv_dim + num_heads_v * head_v].reshape(tokens, num_heads_v, head_v).contiguous(),
            mixed_ba[:, :num_heads_v].contiguous(), mixed_ba[:, num_heads_v:2 * num_heads_v].contiguous())


def fused_sigmoid_mul(attn_output, gate, inplace=False, quant=False):
    """Gated attention's output gate: attn_output [T, heads * dim] * sigmoid(gate) (gate [T, heads, dim] or flat)."""
    if quant:
        _unsupported("fused_sigmoid_mul", "FP8 outputs")
    out = (attn_output.float() * torch.sigmoid(gate.float()).reshape(attn_output.shape)).to(attn_output.dtype)
    return attn_output.copy_(out) if inplace else out


def launch_fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output, output, *, do_add):
    """The shared expert's sigmoid gate: output (+)= sigmoid(hidden_states . gate_weight) * shared_output, per token
    (``fused_gate_sigmoid_mul`` and ``fused_gate_sigmoid_mul_add`` launch their kernel through this)."""
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())[:, None]
    result = gate * shared_output.float() + (output.float() if do_add else 0.0)
    output.copy_(result.to(output.dtype))


def _norm_forward(self, x, z=None):
    return rms_norm_gated(x, self.weight, self.bias, z, self.eps, self.group_size, self.norm_before_gate,
                          self.activation)


def _fused_norm_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    if residual is not None or prenorm or self.weight is None:
        _unsupported("FusedRMSNormGated", "a residual, prenorm or no weight")
    return rms_norm_gated(x, self.weight, self.bias, g, self.eps, None, True, self.activation)


# sglang module -> (its attribute, the stand-in)
STAND_INS = {
    "sglang.kernels.ops.mamba.causal_conv1d_triton": {"causal_conv1d_fn": causal_conv1d_fn,
                                                      "causal_conv1d_update": causal_conv1d_update},
    "sglang.kernels.ops.attention.linear.fused_gdn_gating": {"fused_gdn_gating": fused_gdn_gating},
    "sglang.kernels.ops.attention.fla.chunk": {"chunk_gated_delta_rule": chunk_gated_delta_rule},
    "sglang.kernels.ops.attention.fla.fused_recurrent": {
        "fused_recurrent_gated_delta_rule_packed_decode": fused_recurrent_gated_delta_rule_packed_decode},
    "sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent": {
        "fused_sigmoid_gating_delta_rule_update": fused_sigmoid_gating_delta_rule_update},
    "sglang.kernels.ops.attention.triton_gdn_fused_proj": {
        "fused_qkvzba_split_reshape_cat": fused_qkvzba_split_reshape_cat,
        "fused_qkvzba_split_reshape_cat_contiguous": fused_qkvzba_split_reshape_cat_contiguous},
    "sglang.kernels.ops.elementwise.elementwise": {"fused_sigmoid_mul": fused_sigmoid_mul,
                                                   "_launch_fused_gate_sigmoid_mul": launch_fused_gate_sigmoid_mul},
}
NORMS = {"sglang.kernels.ops.attention.fla.layernorm_gated": ("RMSNorm", _norm_forward),
         "sglang.kernels.ops.attention.fla.fused_norm_gate": ("FusedRMSNormGated", _fused_norm_forward)}


def install(module) -> None:
    """Bind the stand-ins of ``module`` (one of ``STAND_INS`` / ``NORMS``) in place of its Triton kernels."""
    for name, stand_in in STAND_INS.get(module.__name__, {}).items():
        if not hasattr(module, name):
            raise AttributeError(f"patches/sglang_cpu: {module.__name__} has no {name} to stand in for")
        setattr(module, name, stand_in)
    if module.__name__ in NORMS:
        cls, forward = NORMS[module.__name__]
        getattr(module, cls).forward = forward
