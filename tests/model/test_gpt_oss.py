"""gpt-oss (``model.gpt_oss``): what the tiny model exercises, its config reading, its stacked experts, MXFP4.

The logits, export, conversion and score checks under every layout run in the shared launch
(tests/model/test_bridge.py, tests/tools/test_convert.py, tests/tools/test_score.py: ``hf_tiny.VARIANTS["gpt_oss"]``).
Here: (1) transformers-only controls that the tiny model's sliding window, sinks, clamp, router bias and YaRN each
change its logits by far more than the 1e-4 those checks allow, so a bridge or config that dropped one would fail
them; (2) config fields read and refused by name; (3) the per-expert view and its inverse are exact; (4) an MXFP4
checkpoint (quantized here as the released ones are: e2m1 pairs a byte, low nibble first, a power-of-two exponent per
32 values, transposed) reads as transformers' own dequantizer gives it, bit for bit, converts to Megatron and back
to those tensors bit for bit, and scores as transformers on the dequantized twin (fp32, 1e-4).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gspo_megatron.model import gpt_oss
from gspo_megatron.model.errors import UnsupportedModel
from gspo_megatron.model.hf_config import load_config_json, read_hf_config
from gspo_megatron.model.hf_files import DictSource, SafetensorsDir, open_hf_dir
from gspo_megatron.model.layout_check import LayoutError, check_layout
from gspo_megatron.parallel.groups import Layout
from tests.model import hf_tiny, rank_checks

ATOL = 1e-4
MATTERS = 1e-2  # a feature the tiny model exercises moves its logits by more than this


@torch.no_grad()
def _logits(model, tokens):
    return model(tokens).logits


@torch.no_grad()
def test_tiny_gpt_oss_exercises_window_sinks_clamp_router_bias_and_yarn(hf_models):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_models["gpt_oss"], dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    tokens = hf_tiny.input_tokens(model.config.vocab_size)
    reference = _logits(model, tokens)
    assert model.config.sliding_window < tokens.shape[1] and model.config.layer_types[0] == "sliding_attention"

    def moved(change, undo) -> float:
        change()
        try:
            return (_logits(model, tokens) - reference).abs().max().item()
        finally:
            undo()

    # transformers builds the window's mask from config.layer_types at each forward
    layer_types = model.config.layer_types
    assert moved(lambda: setattr(model.config, "layer_types", ["full_attention"] * len(layer_types)),
                 lambda: setattr(model.config, "layer_types", layer_types)) > MATTERS, "the sliding window"
    attention = model.model.layers[0].self_attn
    sinks = attention.sinks.clone()
    assert moved(lambda: attention.sinks.fill_(-1e4), lambda: attention.sinks.copy_(sinks)) > MATTERS, "sinks"
    experts = model.model.layers[0].mlp.experts
    assert moved(lambda: setattr(experts, "limit", 7.0), lambda: setattr(experts, "limit", 1.5)) > MATTERS, "clamp"
    router = model.model.layers[0].mlp.router
    bias = router.bias.clone()
    assert moved(lambda: router.bias.zero_(), lambda: router.bias.copy_(bias)) > MATTERS, "router bias"
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.clone()
    plain = 1.0 / (model.config.rope_parameters["rope_theta"]
                   ** (torch.arange(0, model.config.head_dim, 2, dtype=torch.float) / model.config.head_dim))
    assert moved(lambda: rotary.inv_freq.copy_(plain), lambda: rotary.inv_freq.copy_(inv_freq)) > MATTERS, "YaRN"


def test_config_fields_read_and_refused_by_name(hf_models):
    config = load_config_json(hf_models["gpt_oss"])
    spec = read_hf_config(config)
    assert spec.attention_sinks and spec.linear_bias and spec.sliding_window == 4 and spec.glu_clamp == 1.5
    assert spec.sliding_layers == (True, False) and spec.norm_topk_prob and spec.moe_ffn_hidden_size == 32
    assert spec.yarn_factor == 4.0 and spec.yarn_truncate is False and spec.qkv_bias
    for change, field in ((dict(swiglu_alpha=1.5), "swiglu_alpha=1.5"), (dict(attention_bias=False), "attention_bias"),
                          (dict(layer_types=["sliding_attention", "chunked"]), "layer_types")):
        with pytest.raises(UnsupportedModel, match=field):
            read_hf_config({**config, **change})
    # megatron-core splits biased experts only with expert-TP 1 ("Bias in Moe is only supported when ETP==1")
    with pytest.raises(LayoutError, match="expert_tensor_parallel_size=2: gpt_oss's experts have biases"):
        check_layout(spec, Layout(tensor=2, sequence_parallel=True))
    check_layout(spec, Layout(tensor=2, expert_tensor=1, sequence_parallel=True))


def test_per_expert_view_and_its_inverse_are_exact(hf_models):
    files = SafetensorsDir(hf_models["gpt_oss"])
    tensors = {name: files.read(name) for name in files.shapes()}
    view = gpt_oss.ExpertsView(DictSource(tensors))
    stacked = [n for n in tensors if n.endswith(("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"))]
    assert len(stacked) == 8 and not set(stacked) & set(view.shapes())
    gate = view.read("model.layers.1.mlp.experts.2.gate_proj.weight")
    assert torch.equal(gate, tensors["model.layers.1.mlp.experts.gate_up_proj"][2][:, 0::2].t())
    assert gpt_oss.stacked_shapes(view.shapes()) == files.shapes()
    back = dict(gpt_oss.fuse_experts(((n, view.read(n)) for n in view.shapes()), num_experts=4))
    assert set(back) == set(tensors) and all(hf_tiny.same_bits(back[n], tensors[n]) for n in tensors)


# ---- MXFP4 ----------------------------------------------------------------------------------------------------------

def _quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, a, b] (transformers' layout) -> ([E, b, a / 32, 16] uint8 blocks, [E, b, a / 32] uint8 exponents)."""
    values = torch.tensor(gpt_oss.E2M1_VALUES[:8])
    rows = weight.transpose(1, 2)  # the files hold the transposed weight
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    nibble = (scaled.abs().unsqueeze(-1) - values).abs().argmin(-1) + 8 * (scaled < 0)
    blocks = (nibble[..., 0::2] | (nibble[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_models(hf_models, tmp_path_factory):
    """(MXFP4 directory, its twin dequantized by transformers' ``convert_moe_packed_tensors``), fp32 otherwise."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    source = hf_models["gpt_oss"]
    work = tmp_path_factory.mktemp("mxfp4")
    quantized, twin = work / "mxfp4", work / "dequantized"
    for target in (quantized, twin):
        shutil.copytree(source, target)
    tensors, plain = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _quantize_mxfp4(tensor)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            tensors[name] = plain[name] = tensor
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, twin / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                          "model.layers.*.mlp.router",
                                                                                          "model.embed_tokens", "lm_head"]}
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, twin


def test_mxfp4_reads_as_transformers_dequantizes_it(mxfp4_models, hf_models):
    quantized, twin = mxfp4_models
    source, plain, original = open_hf_dir(quantized), SafetensorsDir(twin), SafetensorsDir(hf_models["gpt_oss"])
    assert not any(n.endswith(("_blocks", "_scales")) for n in source.shapes())
    assert source.shapes() == plain.shapes() and source.dtypes() == plain.dtypes()
    for name in source.shapes():
        assert hf_tiny.same_bits(source.read(name), plain.read(name)), name
    name = "model.layers.1.mlp.experts.down_proj"
    assert hf_tiny.same_bits(source.read(name, (slice(2, 3),)), plain.read(name)[2:3])  # one expert's read
    error = (source.read(name) - original.read(name)).abs().max() / original.read(name).abs().max()
    assert 0 < error < 0.3, f"the quantization is not a quantization of the model ({error:.3f})"


@pytest.mark.megatron
def test_mxfp4_checkpoint_converts_and_scores_as_its_dequantized_twin(mxfp4_models, tmp_path):
    from gspo_megatron.parallel.launch import run_on_ranks
    from gspo_megatron.score import score_with_transformers
    from tests.model.rank_checks import score_records_for_tests

    quantized, twin = mxfp4_models
    back = tmp_path / "back"
    (scores,) = run_on_ranks(rank_checks.quantized_round_trip_case, 1, Layout(), str(quantized), str(tmp_path / "megatron"), str(back),
                             timeout=300)
    rank_checks.assert_export_is_dequantized_twin(back, twin)
    reference = score_with_transformers(twin, score_records_for_tests(read_hf_config(twin).vocab_size), "float32")
    for got, want in zip(scores, reference, strict=True):
        assert got["num_tokens"] == want["num_tokens"]
        assert abs(got["logprob_sum"] - want["logprob_sum"]) <= ATOL, (got, want)


# ---- gradients ------------------------------------------------------------------------------------------------------

def _megatron_gradients(hf_dir: str, tokens: torch.Tensor) -> dict:
    """World 1: the gradient of the mean log-sum-exp of the logits (every weight gets one) as HF-named tensors, read
    through the bridge's export with each parameter's data swapped for its gradient."""
    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.process_groups import ensure_model_parallel
    from gspo_megatron.model.provider import build_gpt_model

    ensure_model_parallel(Layout())
    spec = read_hf_config(hf_dir)
    bridge = Bridge(spec)
    model = build_gpt_model(spec, Layout())
    bridge.load_hf_weights(model, hf_dir)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = model(tokens, positions, attention_mask=None)[..., : spec.vocab_size]
    logits.logsumexp(-1).mean().backward()
    for param in model.parameters():
        param.data = param.grad
    return dict(bridge.export_hf_weights(model))


@pytest.mark.megatron
def test_gradients_equal_transformers(hf_models):
    """Training goes through the biased experts' backward (megatron's in-place bias add, ``fix_megatron_parameters``), the
    sinks, the window and the clamp: every gradient equals transformers' (fp32, 1e-5 relative to the largest)."""
    import transformers

    from gspo_megatron.parallel.launch import run_on_ranks

    hf_dir = hf_models["gpt_oss"]
    tokens = hf_tiny.input_tokens(read_hf_config(hf_dir).vocab_size)
    (ours,) = run_on_ranks(_megatron_gradients, 1, Layout(), str(hf_dir), tokens, timeout=300)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    model(tokens).logits.logsumexp(-1).mean().backward()
    theirs = {name: p.grad for name, p in model.named_parameters()}
    assert set(ours) == set(theirs)
    for name, grad in theirs.items():
        scale = grad.abs().max().item()
        assert scale > 0, f"{name}: transformers gives it no gradient"
        assert (ours[name] - grad).abs().max().item() <= 1e-5 * max(scale, 1e-2), name
