"""The mapping tables and their tensor functions, checked against naive constructions (no process groups)."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.model import mapping, sharding
from gspo_megatron.model.bridge import Bridge
from gspo_megatron.model.errors import MappingError
from gspo_megatron.model.hf_config import read_hf_config
from gspo_megatron.model.hf_files import SafetensorsDir
from tests.model import hf_tiny

HEADS, GROUPS, HEAD_DIM, HIDDEN = 8, 4, 3, 5


def _qkv(bias: bool = False):
    g = torch.Generator().manual_seed(0)
    rest = () if bias else (HIDDEN,)
    return [torch.randn((n * HEAD_DIM,) + rest, generator=g) for n in (HEADS, GROUPS, GROUPS)]


def naive_qkv(q, k, v):
    """Megatron's fused layout written out: per KV group, its query heads, then its k head, then its v head."""
    per_group = HEADS // GROUPS
    rows = []
    for group in range(GROUPS):
        for head in range(group * per_group, (group + 1) * per_group):
            rows.append(q[head * HEAD_DIM : (head + 1) * HEAD_DIM])
        rows.append(k[group * HEAD_DIM : (group + 1) * HEAD_DIM])
        rows.append(v[group * HEAD_DIM : (group + 1) * HEAD_DIM])
    return torch.cat(rows)


@pytest.mark.parametrize("bias", [False, True])
def test_qkv_join_is_megatrons_grouped_layout_and_unjoin_inverts_it(bias):
    q, k, v = _qkv(bias)
    fused = sharding.join(mapping.QKV, [q, k, v], HEADS // GROUPS, HEAD_DIM)
    assert torch.equal(fused, naive_qkv(q, k, v))
    for part, back in zip((q, k, v), sharding.unjoin(mapping.QKV, fused, HEADS // GROUPS, HEAD_DIM)):
        assert torch.equal(part, back)


@pytest.mark.parametrize("tp", [2, 4])
def test_sharding_parts_then_joining_gives_megatrons_tp_shards(tp):
    """Column-parallel fused tensors: rank r's shard is the r-th row block of the full fused tensor for QKV
    (whole query groups per rank), and [gate_r; up_r] for GLU (not a row block of [gate; up])."""
    parts = _qkv()
    fused = naive_qkv(*parts)
    gate, up = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
    for rank in range(tp):
        shards = [p[sharding.local_index(mapping.COLUMN, tuple(p.shape), tp, rank)[0]] for p in parts]
        local = sharding.join(mapping.QKV, shards, HEADS // GROUPS, HEAD_DIM)
        assert torch.equal(local, fused.chunk(tp)[rank])
        glu = [p[sharding.local_index(mapping.COLUMN, (8, HIDDEN), tp, rank)[0]] for p in (gate, up)]
        assert torch.equal(sharding.join(mapping.GLU, glu, 0, 0), torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]))
        row = sharding.local_index(mapping.ROW, (HIDDEN, 8), tp, rank)[0]
        assert row == (slice(None), slice(rank * 8 // tp, (rank + 1) * 8 // tp))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cat_join_is_megatrons_fused_mla_down_projection_and_unjoin_inverts_it(tp):
    """MLA's fused down projection (``linear_qkv_down_proj``): rank r holds [q_a rows block r; kv_a rows block r],
    which megatron's ``FusedMLASelfAttention._qkv_down_projection`` splits at q_lora / TP and gathers per part."""
    q_lora, kv_down = 24, 16 + 8
    q_a, kv_a = torch.randn(q_lora, HIDDEN), torch.randn(kv_down, HIDDEN)
    for rank in range(tp):
        shards = [p[sharding.local_index(mapping.COLUMN, tuple(p.shape), tp, rank)[0]] for p in (q_a, kv_a)]
        local = sharding.join(mapping.CAT, shards, 0, 0)
        q_local, kv_local = local.split([q_lora // tp, kv_down // tp])  # megatron's split of the rank's output
        assert torch.equal(q_local, q_a.chunk(tp)[rank]) and torch.equal(kv_local, kv_a.chunk(tp)[rank])
        back = sharding.unjoin(mapping.CAT, local, 0, 0, (q_lora // tp, kv_down // tp))
        assert all(torch.equal(a, b) for a, b in zip(back, shards))
    with pytest.raises(ValueError, match="do not make"):
        sharding.unjoin(mapping.CAT, torch.zeros(5, 2), 0, 0, (2, 2))


def test_mla_down_projections_are_separate_or_fused_by_the_models_flag(hf_models):
    """The same HF tensors either way; the Megatron names follow megatron's ``mla_down_proj_fusion``."""
    spec = read_hf_config(hf_models["deepseek_v3"])

    def down(fused):
        return [(r.megatron.rsplit(".", 2)[-2], [p.name.rsplit(".", 2)[-2] for p in r.hf])
                for r in mapping.rules_for(spec, fused) if "down_proj" in r.megatron]

    assert down(False) == [("linear_q_down_proj", ["q_a_proj"]), ("linear_kv_down_proj", ["kv_a_proj_with_mqa"])]
    assert down(True) == [("linear_qkv_down_proj", ["q_a_proj", "kv_a_proj_with_mqa"])]
    moonlight = read_hf_config(hf_models["moonlight"])
    assert [r.megatron for r in mapping.rules_for(moonlight) if "down_proj" in r.megatron] == [
        "decoder.layers.{layer}.self_attention.linear_kv_down_proj.weight"]


def test_vocab_rows_are_padded_with_zero_rows_beyond_the_real_vocabulary():
    # vocab 100 padded to 128 over 2 ranks: rank 0 rows 0..63, rank 1 rows 64..99 + 28 zero rows
    assert sharding.local_index(mapping.VOCAB, (100, 4), 2, 0, 128) == ((slice(0, 64), slice(None)), 0)
    assert sharding.local_index(mapping.VOCAB, (100, 4), 2, 1, 128) == ((slice(64, 100), slice(None)), 28)
    # over 8 ranks (16 rows each) rank 6 holds 4 real rows, rank 7 only padding
    assert sharding.local_index(mapping.VOCAB, (100, 4), 8, 6, 128) == ((slice(96, 100), slice(None)), 12)
    assert sharding.local_index(mapping.VOCAB, (100, 4), 8, 7, 128) == ((slice(100, 100), slice(None)), 16)
    assert sharding.local_index(mapping.VOCAB, (100, 4), 1, 0, 128) == ((slice(0, 100), slice(None)), 28)


def test_rule_tables_are_well_formed():
    arity = {mapping.COPY: 1, mapping.QKV: 3, mapping.GATED_QKV: 3, mapping.GLU: 2}
    for family, rules in mapping.ARCHITECTURES.items():
        megatron_names = set()
        for rule in rules:
            if rule.join == mapping.CAT:  # any number of parts, of any sizes
                assert len(rule.hf) >= 2, (family, rule.megatron)
            elif rule.join == mapping.PER_HEAD:  # each part says its sections per key head
                assert len(rule.hf) >= 1 and all(p.per_head for p in rule.hf), (family, rule.megatron)
            else:
                assert len(rule.hf) == arity[rule.join], (family, rule.megatron)
            # a tensor's row sections come in order, all of them, one after the other (the export stacks them)
            names = [p.name for p in rule.hf]
            for part in rule.hf:
                if part.sections:
                    first = names.index(part.name)
                    assert [p.section for p in rule.hf[first:first + len(part.sections)]] == list(
                        range(len(part.sections))), (family, rule.megatron)
            assert (rule.scope == mapping.MODEL) == (rule.stage is not None), (family, rule.megatron)
            assert ("{expert}" in rule.megatron) == (rule.scope == mapping.EXPERT), (family, rule.megatron)
            # Every expert weight has its TEGroupedMLP name (tests/model/test_grouped_experts.py builds that layout).
            assert (rule.grouped is not None) == (rule.scope == mapping.EXPERT), (family, rule.megatron)
            # TE's GroupedLinear names its biases bias{i} beside weight{i} (gpt-oss's experts have biases)
            assert rule.grouped is None or rule.grouped.endswith((".weight{expert}", ".bias{expert}")), rule.grouped
            megatron_names.add((rule.megatron, rule.when, rule.scope))
        assert len(megatron_names) == len(rules), f"{family}: a Megatron tensor is mapped twice"


def test_mapping_names_every_tensor_of_every_tiny_model(hf_models):
    """The table's HF names and shapes are exactly what transformers saved: nothing missing, nothing extra."""
    for name, path in hf_models.items():
        spec = read_hf_config(path)
        saved = SafetensorsDir(path).shapes()
        mtp = {n for n in saved if mapping.mtp_layer_of(spec, n) is not None}  # carried, not mapped
        assert bool(mtp) == (name in hf_tiny.WITH_MTP_TENSORS), name
        assert mapping.hf_tensor_shapes(spec) == {n: s for n, s in saved.items() if n not in mtp}, name
        Bridge(spec).check_hf_tensors(saved)


def test_bad_tensor_sets_name_the_tensors(hf_models):
    spec = read_hf_config(hf_models["qwen3_moe"])
    bridge = Bridge(spec)
    shapes = dict(bridge.hf_tensor_shapes())
    del shapes["model.layers.0.mlp.experts.3.up_proj.weight"]
    shapes["model.layers.0.mlp.shared_expert.gate_proj.weight"] = (16, 32)
    shapes["model.layers.1.self_attn.k_proj.weight"] = (16, 32)
    shapes["model.layers.0.self_attn.rotary_emb.inv_freq"] = (8,)  # old checkpoints: ignored, not unexpected
    with pytest.raises(MappingError) as error:
        bridge.check_hf_tensors(shapes)
    text = str(error.value)
    assert "missing tensors (1): model.layers.0.mlp.experts.3.up_proj.weight" in text
    assert "unexpected tensors (1): model.layers.0.mlp.shared_expert.gate_proj.weight" in text
    assert "model.layers.1.self_attn.k_proj.weight has shape [16, 32], the config needs [32, 32]" in text
    assert "inv_freq" not in text
