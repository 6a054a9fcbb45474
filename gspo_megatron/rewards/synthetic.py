"""The CPU example's synthetic, verifiable tasks, and the character tokenizer and tiny random Qwen3-MoE model
they are served with (built offline: no model hub).

Each task makes prompts with a known answer; ``task_reward(name)`` scores a response against it in [0, 1] with
partial credit per character in its place, so a tiny random policy gets a learning signal from the first step.

    reverse    "rev abc="  -> "cba"        copy   "copy abc=" -> "abc"
    add        "12+7="     -> "19"         count  "count aab=" -> "2a1b" ... (see TASKS)
    mul        "347*86="   -> "29842"      (with ``rollout.env: calculator``: too hard to compute, easy to look up)

A problem may carry a ``demonstration``: the warm start's transcript of a multi-turn solution (``mul``: call the
calculator, read its result, copy it), with deliberate mistakes in some, so RL has something to improve.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .tool_calls import calculator_call, calculator_observation

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS = "<|endoftext|>"
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


def char_tokenizer(vocab_size: int = 128):
    """A transformers fast tokenizer: the special tokens, newline and printable ASCII one id each, then filler
    tokens up to ``vocab_size`` (so every id a random model can sample decodes). EOS (and pad) is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(SPECIAL_TOKENS) + list(CHARS)
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size={vocab_size} is below the {len(tokens)} tokens of the character tokenizer")
    tokens += [f"<|extra_{i}|>" for i in range(len(tokens), vocab_size)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join without spaces
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def tiny_qwen3_moe_config(vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                          num_kv_heads: int = 2, head_dim: int = 16, num_experts: int = 4, top_k: int = 2,
                          moe_intermediate_size: int = 32, max_position_embeddings: int = 512,
                          initializer_range: float = 0.1):
    """A Qwen3-MoE config of the CPU example's shape (fp32; initializer_range 0.1 gives peaked, not uniform,
    next-token distributions, a harder test of log-prob agreement)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, num_experts=num_experts, num_experts_per_tok=top_k,
        norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range, eos_token_id=0, pad_token_id=0, bos_token_id=None, dtype="float32",
    )


def _group_limit(num_experts: int, top_k: int) -> dict:
    """Two expert groups, the top-k chosen within the better one, where a group holds more than top-k experts (else
    the group would be the choice: one group, no limit)."""
    return dict(n_group=2, topk_group=1) if num_experts % 2 == 0 and num_experts // 2 > top_k else dict(n_group=1,
                                                                                                         topk_group=1)


def tiny_glm4_moe_config(vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                         num_kv_heads: int = 2, head_dim: int = 16, num_experts: int = 4, top_k: int = 2,
                         moe_intermediate_size: int = 32, max_position_embeddings: int = 512,
                         initializer_range: float = 0.1):
    """GLM-4.5's architecture at the CPU example's sizes: the first layer dense, one shared expert, a sigmoid
    router with the score-correction bias and a group limit (``_group_limit``), partial rotary (half the head), qkv
    bias, no qk-norm (GLM-4.5's release)."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, n_routed_experts=num_experts,
        num_experts_per_tok=top_k, n_shared_experts=1, first_k_dense_replace=1, **_group_limit(num_experts, top_k),
        routed_scaling_factor=1.0, norm_topk_prob=True, partial_rotary_factor=0.5, attention_bias=True,
        use_qk_norm=False, tie_word_embeddings=False, max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range, eos_token_id=0, pad_token_id=0, bos_token_id=None, dtype="float32",
    )


def tiny_deepseek_v3_config(vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                            num_kv_heads: int = 2, head_dim: int = 16, num_experts: int = 4, top_k: int = 2,
                            moe_intermediate_size: int = 32, max_position_embeddings: int = 512,
                            initializer_range: float = 0.1):
    """DeepSeek-V3's architecture at the CPU example's sizes: multi-latent attention (q and kv LoRA of half the
    hidden size; ``head_dim`` split into equal no-position and rotary parts, values of ``head_dim``), the first layer
    dense, one shared expert, a sigmoid router with the score-correction bias and a group limit (``_group_limit``).
    MLA has no KV heads: ``num_kv_heads`` is unused. The config carries the fields SGLang reads that transformers
    does not define (``serving_fields``), as DeepSeek-V3's release does."""
    from transformers import DeepseekV3Config

    from gspo_megatron.model.hf_config import FAMILIES

    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, n_routed_experts=num_experts, num_experts_per_tok=top_k,
        n_shared_experts=1, first_k_dense_replace=1, **_group_limit(num_experts, top_k), routed_scaling_factor=1.0,
        norm_topk_prob=True, q_lora_rank=hidden_size // 2, kv_lora_rank=hidden_size // 2,
        qk_nope_head_dim=head_dim // 2, qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim,
        tie_word_embeddings=False, max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range, eos_token_id=0, pad_token_id=0, bos_token_id=None, dtype="float32",
        **FAMILIES["deepseek_v3"].serving_fields,
    )


def tiny_qwen3_5_moe_config(vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                            num_kv_heads: int = 2, head_dim: int = 16, num_experts: int = 4, top_k: int = 2,
                            moe_intermediate_size: int = 32, max_position_embeddings: int = 512,
                            initializer_range: float = 0.1):
    """Qwen3.5-MoE's text model (the policy a Qwen3.5 checkpoint trains) at the CPU example's sizes: gated-DeltaNet
    layers (``num_kv_heads`` key and ``num_heads`` value heads of ``head_dim``) with a gated full-attention layer every
    4th and last, a gated shared expert, partial rotary (a quarter of the head), zero-centred norms."""
    from transformers import Qwen3_5MoeTextConfig

    layer_types = ["full_attention" if (i + 1) % 4 == 0 or i == num_layers - 1 else "linear_attention"
                   for i in range(num_layers)]
    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=moe_intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim, num_experts=num_experts,
        num_experts_per_tok=top_k, layer_types=layer_types, linear_num_key_heads=num_kv_heads,
        linear_num_value_heads=num_heads, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=4, tie_word_embeddings=False, max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range, eos_token_id=0, pad_token_id=0, bos_token_id=None, dtype="float32",
    )


def tiny_gpt_oss_config(vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                        num_kv_heads: int = 2, head_dim: int = 16, num_experts: int = 4, top_k: int = 2,
                        moe_intermediate_size: int = 32, max_position_embeddings: int = 512,
                        initializer_range: float = 0.1):
    """gpt-oss's architecture at the CPU example's sizes: sliding-window layers (8 keys: fewer than a prompt and its
    answer) alternating with full ones, attention sinks, biases on every linear, the clamped GLU (its release's
    limit 7), YaRN without truncation (factor 4 over a quarter of the positions). Every layer is MoE; the experts'
    width is its ``intermediate_size``."""
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=moe_intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, num_local_experts=num_experts, num_experts_per_tok=top_k, sliding_window=8,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": max_position_embeddings // 4},
        tie_word_embeddings=False, max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range, eos_token_id=0, pad_token_id=0, bos_token_id=None, dtype="float32",
    )


def tiny_glm_moe_dsa_config(vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                            num_kv_heads: int = 2, head_dim: int = 16, num_experts: int = 4, top_k: int = 2,
                            moe_intermediate_size: int = 32, max_position_embeddings: int = 512,
                            initializer_range: float = 0.1):
    """GLM-5's architecture (DeepSeek sparse attention, megatron-core 0.19.2) at the CPU example's sizes: the tiny
    DeepSeek-V3's MLA and router, plus an indexer of 32 heads (GLM-5's count) of ``head_dim`` keeping 8 keys per query
    (fewer than a prompt and its answer: the sparse choice matters). Not fewer heads: a key whose relu(q . k) is 0 in
    every head scores exactly 0, and ties at the top-k's edge are broken differently by a prefill and a full forward
    (with 4 heads the engine's first token was 0.06 off the trainer's)."""
    from transformers import GlmMoeDsaConfig

    from gspo_megatron.model.hf_config import FAMILIES

    return GlmMoeDsaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, n_routed_experts=num_experts, num_experts_per_tok=top_k,
        n_shared_experts=1, first_k_dense_replace=1, **_group_limit(num_experts, top_k), routed_scaling_factor=1.0,
        norm_topk_prob=True, q_lora_rank=hidden_size // 2, kv_lora_rank=hidden_size // 2,
        qk_nope_head_dim=head_dim // 2, qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim,
        index_n_heads=32, index_head_dim=head_dim, index_topk=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range, eos_token_id=0, pad_token_id=0, bos_token_id=None, dtype="float32",
        **FAMILIES["glm_moe_dsa"].serving_fields,
    )


def tiny_minimax_m2_config(vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                           num_kv_heads: int = 2, head_dim: int = 16, num_experts: int = 4, top_k: int = 2,
                           moe_intermediate_size: int = 32, max_position_embeddings: int = 512,
                           initializer_range: float = 0.1):
    """MiniMax-M2's architecture at the CPU example's sizes: q/k RMSNorm over the whole projection, a sigmoid router
    with the score-correction bias (no groups), RoPE on half of each head (``rotary_dim``), every layer MoE (the
    experts' width is its ``intermediate_size``). The config carries the fields SGLang reads that transformers does
    not define (``serving_fields``), as MiniMax-M2's release does."""
    from transformers import MiniMaxM2Config

    from gspo_megatron.model.hf_config import FAMILIES

    return MiniMaxM2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=moe_intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, rotary_dim=head_dim // 2, num_local_experts=num_experts, num_experts_per_tok=top_k,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False, max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range, eos_token_id=0, pad_token_id=0, bos_token_id=None, dtype="float32",
        **FAMILIES["minimax_m2"].serving_fields,
    )


# model.tiny's ``family``: the architectures a tiny random model can be built in, from the same size fields.
TINY_FAMILIES = {"qwen3_moe": tiny_qwen3_moe_config, "glm4_moe": tiny_glm4_moe_config,
                 "deepseek_v3": tiny_deepseek_v3_config, "qwen3_5_moe": tiny_qwen3_5_moe_config,
                 "gpt_oss": tiny_gpt_oss_config, "glm_moe_dsa": tiny_glm_moe_dsa_config,
                 "minimax_m2": tiny_minimax_m2_config}


def tiny_config(family: str = "qwen3_moe", **sizes):
    """The transformers config of a tiny ``family`` model (``model.tiny``: ``family`` and the size fields)."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"model.tiny.family={family!r}: one of {sorted(TINY_FAMILIES)}")
    return TINY_FAMILIES[family](**sizes)


def save_tiny_model(path: str | Path, seed: int = 0, **tiny) -> Path:
    """Write a random tiny model (``tiny_config``: Qwen3-MoE unless ``family`` says otherwise) + the character
    tokenizer as a Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = tiny_config(**tiny)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(path)
    char_tokenizer(config.vocab_size).save_pretrained(path)
    return path


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    demonstration: tuple[tuple[str, bool], ...] = ()
    """What the warm start trains on after the prompt, as (text, trained) segments: the model's turns (trained) and
    the environment's observations (not). Empty: the answer and EOS."""


def demonstration(problem: Problem) -> list[tuple[str, bool]]:
    """The warm start's transcript of ``problem``: [(prompt, False), (text, trained), ...]; EOS ends each turn."""
    return [(problem.prompt, False)] + list(problem.demonstration or [(problem.answer + EOS, True)])


def _word(rng: random.Random, lo: int = 2, hi: int = 5) -> str:
    return "".join(rng.choice("abcdefgh") for _ in range(rng.randint(lo, hi)))


def _count(word: str) -> str:
    out, i = [], 0
    while i < len(word):
        j = i
        while j < len(word) and word[j] == word[i]:
            j += 1
        out.append(f"{j - i}{word[i]}")
        i = j
    return "".join(out)


# The mul task's demonstrations: a share answers at once with a guess (the tool skipped), and a share of those that
# call the tool copy one digit of its result wrong; the rest are right. RL learns to call it and to copy exactly.
MUL_SKIP_TOOL = 0.4
MUL_MISCOPY = 0.3


def _miscopy(number: str, rng: random.Random) -> str:
    i = rng.randrange(len(number))
    return number[:i] + rng.choice([d for d in "0123456789" if d != number[i]]) + number[i + 1:]


def _mul(rng: random.Random) -> Problem:
    """A 3-digit by 2-digit product: a tiny model cannot compute it, but can copy it from the calculator."""
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    answer = str(a * b)
    if rng.random() < MUL_SKIP_TOOL:
        guess = str(rng.randint(1000, 99999))
        return Problem(f"{a}*{b}=", answer, ((guess + EOS, True),))
    copied = _miscopy(answer, rng) if rng.random() < MUL_MISCOPY else answer
    return Problem(f"{a}*{b}=", answer, ((calculator_call(f"{a}*{b}") + EOS, True),
                                          (calculator_observation(answer), False), (copied + EOS, True)))


TASKS: dict[str, Callable[[random.Random], Problem]] = {
    "reverse": lambda rng: (lambda w: Problem(f"rev {w}=", w[::-1]))(_word(rng)),
    "copy": lambda rng: (lambda w: Problem(f"copy {w}=", w))(_word(rng)),
    # responses of 64-72 tokens: the mismatch benchmark's long task (per-sequence means over many tokens)
    "copy_long": lambda rng: (lambda w: Problem(f"copy {w}=", w))(_word(rng, 64, 72)),
    "add": lambda rng: (lambda a, b: Problem(f"{a}+{b}=", str(a + b)))(rng.randint(0, 49), rng.randint(0, 49)),
    "count": lambda rng: (lambda w: Problem(f"count {w}=", _count(w)))(_word(rng)),
    "mul": _mul,
}


def make_problems(task: str, count: int, seed: int = 0) -> list[Problem]:
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not one of {sorted(TASKS)}")
    rng = random.Random(seed)
    return [TASKS[task](rng) for _ in range(count)]


def position_credit(response: str, answer: str) -> float:
    """Characters in their place, over the longer of response and answer, scaled to 0.9; 1.0 only for the exact
    answer (which includes stopping after it).

    Each position earns its credit on its own (not only up to the first mistake), so every character of the
    answer gives a learning signal from the first steps; dividing by the longer length makes extra characters
    cost credit, so padding a response (with a letter that often repeats, say) does not pay.
    """
    response = response.split(EOS, 1)[0].strip()
    if response == answer:
        return 1.0
    right = sum(a == b for a, b in zip(response, answer))
    return 0.9 * right / max(1, len(answer), len(response))


def position_credit_segments(response_tokens: list[str], answer: str) -> list[tuple[int, float]]:
    """``position_credit`` split over the response's tokens, each token a segment: a token earns the credit of the
    answer characters it puts in their place, the last token also the exact answer's bonus, so the rewards sum
    to ``position_credit`` of the whole response. Returns [(end, reward)] with end = 1 .. len(response_tokens)."""
    text = "".join(response_tokens)
    response = text.split(EOS, 1)[0]
    stripped = response.strip()
    offset = len(response) - len(response.lstrip())
    owner = [j for j, token in enumerate(response_tokens) for _ in token]  # the token of each character
    longer = max(1, len(answer), len(stripped))
    rewards = [0.0] * len(response_tokens)
    for i, (got, want) in enumerate(zip(stripped, answer)):
        if got == want:
            rewards[owner[offset + i]] += 0.9 / longer
    if rewards:
        rewards[-1] += position_credit(text, answer) - sum(rewards)
    return [(j + 1, r) for j, r in enumerate(rewards)]
