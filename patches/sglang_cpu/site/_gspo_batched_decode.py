"""Batched decode attention for SGLang's ``torch_native`` backend (the one ``--device cpu`` uses).

sglang 0.5.23's ``TorchNativeAttnBackend._run_sdpa_forward_decode`` loops over the running requests in Python,
gathering each one's keys and values and calling SDPA once per request and layer ("TODO: this loop process a
sequence per iter, this is inefficient"). With 64 requests that is ~500 small SDPA calls and ~5000 tensor ops per
decode step; a profile of a 115M Qwen3-MoE server put 34% of its forward there. Here every request's keys and
values are gathered at once into [B, max_len] (padding positions masked out) and attended in one SDPA call: the
same softmax over the same keys, in one batch.

Cases the loop handles that this does not (cross-attention, encoder lengths, sliding windows) and batches whose
padded key/value copy would exceed ``MAX_GATHER_BYTES`` go to the original loop.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

MAX_GATHER_BYTES = 256 << 20  # the padded K and V copies of one layer


def batched_decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, scaling=None,
                   enable_gqa=False):
    """query, output: [B, Hq, D] (one new token per request); k_cache, v_cache: [slots, Hkv, D]; req_to_token:
    [max_reqs, max_context]; req_pool_indices, seq_lens: [B]. Writes and returns ``output``."""
    max_len = int(seq_lens.max())
    valid = torch.arange(max_len, device=seq_lens.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, L]
    slots = torch.where(valid, req_to_token[req_pool_indices, :max_len], 0)  # masked positions read slot 0
    key = k_cache[slots].to(query.dtype).transpose(1, 2)  # [B, Hkv, L, D]
    value = v_cache[slots].to(query.dtype).transpose(1, 2)
    out = scaled_dot_product_attention(query.unsqueeze(2), key, value, attn_mask=valid[:, None, None, :],
                                       scale=scaling, enable_gqa=enable_gqa)  # [B, Hq, 1, D]
    output.copy_(out.squeeze(2))
    return output


def install(backend_class) -> None:
    """Route ``backend_class._run_sdpa_forward_decode`` through ``batched_decode`` where it applies."""
    original = backend_class._run_sdpa_forward_decode
    if getattr(original, "_gspo_batched", False):
        return

    def run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                encoder_lens=None, scaling=None, enable_gqa=False, causal=False,
                                is_cross_attn=False, sliding_window_size=None):
        batch = seq_lens.shape[0]
        gather = 2 * batch * int(seq_lens.max()) * k_cache[0].numel() * query.element_size() if batch else 0
        plain = (encoder_lens is None and not is_cross_attn and not causal
                 and (sliding_window_size is None or sliding_window_size <= -1)
                 and batch == query.shape[0] and gather <= MAX_GATHER_BYTES)
        if not plain or batch == 0:
            return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                            encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)
        return batched_decode(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                              scaling, enable_gqa)

    run_sdpa_forward_decode._gspo_batched = True
    backend_class._run_sdpa_forward_decode = run_sdpa_forward_decode
