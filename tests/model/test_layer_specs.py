"""The layer specs the provider builds: a MoE layer's pre-MLP norm keeps its own checkpoint name on megatron's
local spec (as TransformerEngine's spec names it), so a checkpoint written on CPU loads into a TE model; dense
layers keep megatron's fused-norm key. megatron-core 0.16 describes MoE layers as ModuleSpecs, 0.19 as builder
partials: both legs of the suite run this."""

from __future__ import annotations

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from tests.model import hf_tiny


def _keys_maps(hf_dir: str) -> list[dict]:
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.process_groups import ensure_model_parallel
    from gspo_megatron.model.provider import decoder_block_spec, transformer_config

    ensure_model_parallel(Layout())
    spec = read_hf_config(f"{hf_dir}/config.json")
    block = decoder_block_spec(transformer_config(spec, Layout()), use_te=False)
    return [dict(s.submodules.sharded_state_dict_keys_map) for s in block.layer_specs]


def test_moe_norm_keeps_its_name_on_the_local_spec(tmp_path):
    hf_dir = hf_tiny.save_variant("qwen3_moe", tmp_path)  # layer 0 MoE, layer 1 dense (mlp_only_layers=[1])
    (maps,) = run_on_ranks(_keys_maps, 1, Layout(), str(hf_dir))
    moe, dense = maps
    assert "pre_mlp_layernorm." not in moe, moe
    assert dense.get("pre_mlp_layernorm.") == "mlp.linear_fc1.layer_norm_", dense
