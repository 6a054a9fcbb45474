"""The Megatron policy and the Hugging Face bridge.

    hf_config     config.json -> ModelSpec; the supported families as a table (Qwen3-MoE, Qwen3, Qwen2, Llama)
    layout_check  does a parallel layout fit the model? (before any process group starts)
    provider      ModelSpec + layout -> TransformerConfig and this rank's GPTModel (local spec / TE spec)
    mapping       the HF <-> Megatron tensor tables: names, joins (fused QKV, [gate; up]), TP/EP splits
    sharding      those joins and splits as tensor functions
    bridge        Bridge.load_hf_weights / Bridge.export_hf_weights: used by conversion, weight sync, local engine
    hf_files      safetensors reading (lazy, sliced) and sharded writing with an index
    hub           Hugging Face repo ids where a model directory is expected: their huggingface_hub snapshot
    checkpoint    Megatron torch_dist checkpoints with the metadata to rebuild the model
    convert       hf_to_megatron / megatron_to_hf (tools/convert_*.py are their command lines)
    atomic        output directories that appear complete or not at all
    hidden_output the last stage's hidden states instead of logits (for the fused log-prob op)

Megatron-Core is imported inside the functions that need it, so reading configs and checking layouts is cheap;
importing this package imports neither torch nor megatron (the command-line tools start fast).
"""

from .errors import LayoutError, MappingError, UnsupportedModel
from .hf_config import FAMILIES, ModelSpec, read_hf_config

__all__ = ["FAMILIES", "LayoutError", "MappingError", "ModelSpec", "UnsupportedModel", "read_hf_config"]
