"""The Megatron policy and the Hugging Face bridge.

    hf_config     config.json -> ModelSpec; the supported families as a table (Qwen3 / Qwen3-MoE, Qwen2, Llama,
                  GLM-4.5, DeepSeek-V3 / Kimi-K2, Qwen3.5 / Qwen3-Next, gpt-oss, MiniMax-M2, GLM-5 / DeepSeek-V3.2)
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
    process_groups torch.distributed and Megatron's groups for a layout, reused where they fit
    errors        the package's errors, each naming the field, tensor or layout setting at fault

What a family adds beyond the tables, one module each:
    mla           DeepSeek-V3's multi-latent attention on the local spec
    dsa           DeepSeek sparse attention (GLM-5, DeepSeek-V3.2; megatron-core 0.19)
    gated_deltanet  the gated-DeltaNet hybrids' layers (Qwen3.5, Qwen3-Next), packed sequences included
    gpt_oss       gpt-oss's fields, fused experts and MXFP4 checkpoints
    minimax_m2    MiniMax-M2's fields and its whole-projection q/k norm, TP-aware
Checkpoint formats:
    tensor_source what every reader of named tensors offers (names, shapes, sliced reads)
    fp8           block-scaled FP8: dequantized on read, quantized for FP8 rollouts and exports

Megatron-Core is imported inside the functions that need it, so reading configs and checking layouts is cheap;
importing this package imports neither torch nor megatron (the command-line tools start fast).
"""

from .errors import LayoutError, MappingError, UnsupportedModel
from .hf_config import FAMILIES, ModelSpec, read_hf_config

__all__ = ["FAMILIES", "LayoutError", "MappingError", "ModelSpec", "UnsupportedModel", "read_hf_config"]
