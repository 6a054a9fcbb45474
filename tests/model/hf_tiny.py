"""Tiny random Hugging Face models of every supported family, built locally with ``transformers`` (fp32).

Each variant exercises something the bridge must get right: GQA with head_dim != hidden / heads, q/k norm,
qkv bias, tied and untied embeddings, a vocabulary that Megatron pads (100 -> 128 rows), Qwen3-MoE with
``mlp_only_layers`` and with ``decoder_sparse_step``, renormalised and plain top-k routing, Llama-3 RoPE
scaling, GLM-4.5 (a dense first layer, sigmoid routing with nonzero expert biases and a group limit, shared
experts, qkv bias, qk-norm, partial rotary). Weights are drawn at unit-ish scale (not transformers' 0.02) so logits and routing are far from
degenerate; norms are perturbed away from 1. A word-level tokenizer is built offline with ``tokenizers``
so the directories carry tokenizer files like a real checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

SEQ, BATCH = 12, 2

_COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=64, rms_norm_eps=1e-6, max_position_embeddings=64)

VARIANTS: dict[str, tuple[str, dict]] = {
    # MoE in layer 0, dense layer 1; softmax -> top-2 -> renormalise
    "qwen3_moe": ("Qwen3MoeConfig", dict(_COMMON, vocab_size=128, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1],
                                         tie_word_embeddings=False)),
    # dense layer 0, MoE layer 1 (decoder_sparse_step=2); softmax -> top-2, no renormalisation; tied; padded vocab
    "qwen3_moe_step2": ("Qwen3MoeConfig", dict(_COMMON, vocab_size=100, head_dim=8, num_experts=4,
                                               num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=False,
                                               decoder_sparse_step=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(_COMMON, vocab_size=128, head_dim=16, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2": ("Qwen2Config", dict(_COMMON, vocab_size=100, tie_word_embeddings=False)),
    "llama": ("LlamaConfig", dict(_COMMON, vocab_size=128, tie_word_embeddings=False, max_position_embeddings=16384,
                                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192})),
    # dense layer 0, MoE layer 1: 8 experts in 4 groups, the best 2 groups, top-4 of their experts (the limit
    # changes the choice: test_group_limit_changes_the_choice), sigmoid + bias, scale 2.5, one shared expert,
    # qkv bias, qk-norm, RoPE on half of each head; the config declares an MTP layer the checkpoint lacks.
    "glm4_moe": ("Glm4MoeConfig", dict(_COMMON, vocab_size=100, head_dim=16, n_routed_experts=8, num_experts_per_tok=4,
                                       n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=16,
                                       first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                       use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                                       num_nextn_predict_layers=1, tie_word_embeddings=False)),
    # DeepSeek-V3: multi-latent attention with q LoRA (q 24, kv 16, nope 8, rope 8, v 12), YaRN with mscale (the
    # softmax scale too), the same sigmoid router as GLM (8 experts, 4 groups, best 2, top-4), two shared experts.
    "deepseek_v3": ("DeepseekV3Config", dict(_COMMON, num_key_value_heads=4, vocab_size=128, n_routed_experts=8,
                                             num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
                                             moe_intermediate_size=16, first_k_dense_replace=1,
                                             routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16,
                                             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                              "original_max_position_embeddings": 16,
                                                              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8,
                                                              "mscale_all_dim": 1.0},
                                             tie_word_embeddings=False)),
    # Moonlight's shape: no q LoRA (one q_proj), plain RoPE, no group limit, padded vocabulary; three layers, which
    # two pipeline stages can only split unevenly (as DeepSeek-V3's 61: rank_checks' pp2 runs first_stage_layers=1).
    "moonlight": ("DeepseekV3Config", dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, vocab_size=100,
                                           n_routed_experts=4,
                                           num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                                           moe_intermediate_size=16, first_k_dense_replace=1,
                                           routed_scaling_factor=2.0, q_lora_rank=None, kv_lora_rank=16,
                                           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                                           tie_word_embeddings=False)),
    # gpt-oss: sliding windows of 4 keys (< SEQ) in layer 0, full attention in layer 1, attention sinks, biases on
    # every linear, 4 experts top-2 stacked in the files, the GLU clamped at 1.5 (not 7: so the clamp bites at these
    # weights), YaRN without truncation, head_dim != hidden / heads.
    "gpt_oss": ("GptOssConfig", dict(_COMMON, vocab_size=128, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=32, sliding_window=4, swiglu_limit=1.5,
                                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                      "original_max_position_embeddings": 16},
                                     tie_word_embeddings=False)),
    # MiniMax-M2: q/k norm over the whole projection (not per head), sigmoid router + bias without groups (4 experts,
    # top-2, renormalised), RoPE on half of each head, every layer MoE, experts as block_sparse_moe.experts.{e}.w1/w2/w3.
    "minimax_m2": ("MiniMaxM2Config", dict(_COMMON, vocab_size=100, head_dim=16, num_local_experts=4,
                                           num_experts_per_tok=2, intermediate_size=16,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5},
                                           tie_word_embeddings=False)),
}
# The gated-DeltaNet hybrids (Qwen3.5 dense and MoE as their vision-language checkpoints, Qwen3-Next as a causal LM):
# four layers, three linear-attention (DeltaNet) and one gated full-attention layer (layer_types' default); 2 key /
# 4 value heads in the DeltaNet (each key head serves two value heads, and TP=2 splits both), partial rotary 0.25 on
# a head of 16 (Qwen3.5's interleaved mrope sections over the 2 rotary frequencies), a shared expert with a gate.
# Separate from VARIANTS: their own launch (tests/model/test_gated_deltanet.py).
_HYBRID_TEXT = dict(_COMMON, num_hidden_layers=4, head_dim=16, vocab_size=100, linear_conv_kernel_dim=4,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                    tie_word_embeddings=False)
_NO_DENSE_MLP = {k: v for k, v in _HYBRID_TEXT.items() if k != "intermediate_size"}
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
          "mrope_interleaved": True}
_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
               num_position_embeddings=64, deepstack_visual_indexes=[])
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
HYBRID_VARIANTS: dict[str, tuple[str, dict]] = {
    # as Qwen3.5-MoE's releases: no intermediate_size (no dense MLP)
    "qwen3_5_moe": ("Qwen3_5MoeConfig", dict(text_config=dict(_NO_DENSE_MLP, **_MOE, rope_parameters=_MROPE),
                                             vision_config=_VISION)),
    "qwen3_5": ("Qwen3_5Config", dict(text_config=dict(_HYBRID_TEXT, vocab_size=128, rope_parameters=_MROPE),
                                      vision_config=_VISION)),
    # a causal LM (no vision tower), plain 1-D RoPE, in_proj_qkvz / in_proj_ba per key head
    "qwen3_next": ("Qwen3NextConfig", dict(_HYBRID_TEXT, **_MOE, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
}
# DeepSeek sparse attention (megatron-core 0.19.2 only; their own launch: tests/model/test_dsa.py): DeepSeek-V3's tiny
# MLA and router with an indexer of 4 heads of 16 choosing 4 keys per query (< SEQ: from the fifth token on, each
# query attends to 4 of its earlier tokens); GLM-5 with plain RoPE and the indexer's RoPE interleaved, DeepSeek-V3.2
# with YaRN and the indexer's RoPE half-split.
_DSA = dict(_COMMON, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
            n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1, routed_scaling_factor=2.5,
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, index_n_heads=4,
            index_head_dim=16, index_topk=4, tie_word_embeddings=False)
DSA_VARIANTS: dict[str, tuple[str, dict]] = {
    "glm_moe_dsa": ("GlmMoeDsaConfig", dict(_DSA, vocab_size=100, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 10000.0})),
    "deepseek_v32": ("DeepseekV32Config", dict(_DSA, vocab_size=128, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0})),
}
# vision-language configs: the class that holds the text model and the vision tower
WRAPPER_MODELS = {"Qwen3_5MoeConfig": "Qwen3_5MoeForConditionalGeneration",
                  "Qwen3_5Config": "Qwen3_5ForConditionalGeneration"}
MOE_VARIANTS = [name for name, (cls, _) in VARIANTS.items()
                if "Moe" in cls or cls.startswith("DeepseekV3") or cls in ("GptOssConfig", "MiniMaxM2Config")]
EXPERT_BIAS_VARIANTS = ["gpt_oss"]  # megatron-core splits biased experts only with expert-TP 1
MLA_VARIANTS = [name for name, (cls, _) in VARIANTS.items() if cls.startswith("DeepseekV3")]  # no fused q/k/v
UNPADDED_VARIANTS = [name for name, (_, kw) in VARIANTS.items() if kw["vocab_size"] % 128 == 0]


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=g)
        if param.ndim == 1 and "norm" in name:
            param.copy_(1.0 + 0.2 * noise)
        elif param.ndim == 1:  # biases
            param.copy_(0.1 * noise)
        else:
            param.copy_(noise / math.sqrt(param.shape[-1]))
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):  # the sigmoid router's bias: on the scale of score gaps
            buffer.copy_(0.1 * torch.randn(buffer.shape, generator=g))


def build_tokenizer(vocab_size: int):
    """A word-level tokenizer t0 .. t{V-1} (t0 is <unk>), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", eos_token=f"t{vocab_size - 1}")


def build_hf_model(variant: str, seed: int = 0):
    import transformers

    cls_name, kwargs = {**VARIANTS, **HYBRID_VARIANTS, **DSA_VARIANTS}[variant]
    config = getattr(transformers, cls_name)(**kwargs)
    if cls_name in WRAPPER_MODELS:
        config._attn_implementation = "eager"
        model = getattr(transformers, WRAPPER_MODELS[cls_name])(config).to(torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize(model, seed)
    return model.eval()


def load_hf_model(model_dir: Path):
    """A saved tiny model as transformers loads it (the vision-language wrappers by their class), fp32, eager."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    cls = getattr(transformers, WRAPPER_MODELS.get(type(config).__name__, "AutoModelForCausalLM"))
    return cls.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()


def input_tokens(vocab_size: int, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def save_variant(variant: str, directory: Path, seed: int = 0) -> Path:
    """Save the model (safetensors + config + tokenizer) and its reference logits for ``input_tokens``.

    ``directory/reference.pt`` (outside the model dir) holds {"tokens", "logits"} from transformers.
    """
    model = build_hf_model(variant, seed)
    model_dir = directory / variant
    model.save_pretrained(model_dir)
    if variant in WITH_MTP_TENSORS:
        add_mtp_tensors(model_dir, model.config, seed)
    if variant in WITH_QWEN_MTP_TENSORS:
        add_qwen_mtp_tensors(model_dir, seed)
    vocab_size = model.config.get_text_config().vocab_size
    build_tokenizer(vocab_size).save_pretrained(model_dir)
    tokens = input_tokens(vocab_size)
    with torch.no_grad():
        logits = model(tokens).logits
    torch.save({"tokens": tokens, "logits": logits}, directory / f"{variant}.reference.pt")
    return model_dir


# Variants whose checkpoint holds the MTP layer its config declares (transformers builds none: written here, as
# DeepSeek-V3's release stores it, layer num_hidden_layers); glm4_moe declares one and holds none, like a re-save.
WITH_MTP_TENSORS = ("deepseek_v3",)


def add_mtp_tensors(model_dir: Path, config, seed: int) -> None:
    """Append a few tensors of MTP layer ``num_hidden_layers`` (its projection, norms, router bias) to the checkpoint."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(1000 + seed)
    hidden, layer = config.hidden_size, f"model.layers.{config.num_hidden_layers}"
    tensors = load_file(model_dir / "model.safetensors")
    tensors.update({f"{layer}.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g),
                    f"{layer}.enorm.weight": torch.randn(hidden, generator=g),
                    f"{layer}.hnorm.weight": torch.randn(hidden, generator=g),
                    f"{layer}.shared_head.norm.weight": torch.randn(hidden, generator=g),
                    f"{layer}.mlp.gate.e_score_correction_bias": torch.randn(config.n_routed_experts, generator=g)})
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


WITH_QWEN_MTP_TENSORS = ("qwen3_5_moe", "qwen3_next")


def add_qwen_mtp_tensors(model_dir: Path, seed: int) -> None:
    """A few of the mtp.* tensors Qwen3.5's and Qwen3-Next's releases store (transformers builds none; the config
    declares mtp_num_hidden_layers), at their own prefix beside model.language_model.* and model.visual.*
    (Qwen3-Next: model.*)."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)  # Qwen3-Next: a causal LM's config
    hidden = text["hidden_size"]
    g = torch.Generator().manual_seed(2000 + seed)
    tensors = load_file(model_dir / "model.safetensors")
    tensors.update({"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=g),
                    "mtp.pre_fc_norm_embedding.weight": torch.randn(hidden, generator=g),
                    "mtp.norm.weight": torch.randn(hidden, generator=g),
                    "mtp.layers.0.self_attn.q_proj.weight": torch.randn(64, hidden, generator=g).to(torch.bfloat16)})
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))


def save_resaved_text_model(vision_language_dir: Path, target: Path) -> Path:
    """A Qwen3.5 vision-language checkpoint loaded as its causal LM and saved again, as a fine-tune re-saves it:
    model_type ``qwen3_5_moe_text`` (or ``qwen3_5_text``), the text model's tensors still under
    ``model.language_model.`` (transformers reverses its load-time rename on save), no vision tower, no mtp.*."""
    import shutil

    import transformers

    cls = {"Qwen3_5MoeConfig": "Qwen3_5MoeForCausalLM", "Qwen3_5Config": "Qwen3_5ForCausalLM"}
    config = transformers.AutoConfig.from_pretrained(vision_language_dir)
    model = getattr(transformers, cls[type(config).__name__]).from_pretrained(vision_language_dir, dtype=torch.float32)
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(vision_language_dir / name, target / name)
    return target


def save_bf16_copy(source: Path, target: Path) -> Path:
    """The checkpoint cast to bf16, as real ones are (conversion must keep dtypes, bit for bit)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = {name: t.to(torch.bfloat16) for name, t in load_file(target / "model.safetensors").items()}
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2))
    return target


BF16 = "qwen3_moe_bf16"  # for conversion only: not in VARIANTS (its logits are not compared at 1e-4)


def build_all(directory: Path) -> dict[str, Path]:
    """Every variant under ``directory`` (and ``BF16``), built once: another test folder's fixture reuses them."""
    done = directory / "complete"
    if not done.exists():
        directory.mkdir(parents=True, exist_ok=True)
        for i, variant in enumerate(VARIANTS):
            save_variant(variant, directory, seed=i)
        save_bf16_copy(directory / "qwen3_moe", directory / BF16)
        done.touch()
    return {variant: directory / variant for variant in VARIANTS}


def bf16_model(hf_models: dict[str, Path]) -> Path:
    return hf_models["qwen3_moe"].parent / BF16


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (stricter than torch.equal: -0.0 != 0.0, NaN payloads compared)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def save_kimi_k25(text_model: Path, target: Path) -> Path:
    """A tiny Kimi-K2.5 checkpoint as SGLang's ``KimiK25ForConditionalGeneration`` reads one: the text model's
    config as ``text_config`` (model_type ``kimi_k2``) and its tensors under ``language_model.``, beside a small
    stand-in vision tower and projector (``vision_tower.*``, ``mm_projector.*``) the policy must carry, not train."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(text_model, target)
    g = torch.Generator().manual_seed(7)
    tensors = {f"language_model.{n}": t for n, t in load_file(target / "model.safetensors").items()}
    tensors.update({"vision_tower.patch_embed.proj.weight": torch.randn(8, 3, 2, 2, generator=g),
                    "vision_tower.encoder.blocks.0.wqkv.weight": torch.randn(24, 8, generator=g),
                    "mm_projector.proj.0.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16)})
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    text = {**json.loads((target / "config.json").read_text()), "model_type": "kimi_k2"}
    config = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "text_config": text,
              "vision_config": {"vt_hidden_size": 8, "vt_num_hidden_layers": 1, "mm_hidden_size": 8}}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
