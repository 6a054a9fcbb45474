"""SGLang's own model class built in-process on CPU, and its real ``load_weights`` fed our tensors; run as a script
in a process of its own, with the CPU stand-ins on PYTHONPATH (``patches.sglang_cpu``), by
``tests/rollout/test_deepseek_sglang_names.py``, ``test_gpt_oss_sglang_names.py``,
``test_minimax_m2_sglang_names.py`` and ``test_glm5_sglang_names.py``:

    python -m tests.rollout.sglang_load MODEL_DIR LOADS.pt OUT.pt [MODEL_DIR LOADS.pt OUT.pt ...]

One process for every model given (its SGLang import, ~10 s on CPU, paid once), built one after another.

No server and no forward pass: SGLang's CPU attention cannot run MLA (docs/models.md), but building the model and
loading weights are the same code its server runs at start-up (``DefaultModelLoader``) and on every weight update
(``update_weights_from_distributed`` / ``_from_tensor`` call ``load_weights`` once per bucket). The model is built
with ``load_format="dummy"`` (random weights, no files read) on a one-rank gloo group (formed once).

``LOADS.pt`` is ``{load: [call, ...]}``, each call a list of ``(name, tensor)``, the string ``"files"`` (SGLang's
safetensors iterator over MODEL_DIR, as its start-up load reads it; ``("files", DIR)``: over another directory), a
flattened bucket (``{"flattened_tensor", "metadata"}``, what ``update_weights_from_tensor`` receives: unpacked by
SGLang's own ``FlattenedTensorBucket``) or ``("distributed", names, dtypes, shapes, bytes)``, a packed broadcast
received as ``update_weights_from_distributed`` receives it (``FlattenedTensorBucket.empty`` filled with the bytes).
For each load every SGLang parameter is first filled with NaN, then the calls run in order. A MODEL_DIR whose
config.json has a ``quantization_config`` is built in bf16 (SGLang's Fp8Config refuses fp32), else in fp32.
``OUT.pt`` gets per load: ``params`` (every parameter after it),
``routing_bias`` (per MoE layer, the correction bias its top-k routes with), ``w_kc`` / ``w_vc`` (the MLA up-projection
halves ``post_load_weights`` derives from ``kv_b_proj``) and ``warnings`` (what SGLang's loader logged, e.g. a name
"not found in params_dict").
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path

import torch

from gspo_megatron.parallel.groups import free_port


# SGLang refuses to build gpt-oss with the CPU's torch_native attention (it has neither sliding windows nor sinks);
# no attention runs here, so the build names one it accepts.
BUILD_ATTENTION = {"GptOssForCausalLM": "triton"}


def _device_capability(config: dict):
    """For a DeepSeek-sparse-attention model (GLM-5, DeepSeek-V3.2: ``index_topk``), a CUDA capability while the
    server args resolve. SGLang 0.5.23's server-args hook (``arg_groups/model_hook.handle_model_specific_adjustments``)
    asks ``torch.cuda.get_device_capability()`` for every DSA model on a non-NPU/XPU platform, to pick its KV-cache
    dtype and attention backends: on a CPU that raises ("Torch not compiled with CUDA enabled") before anything is
    built. Only the server args' resolution runs under it (the model's build and its loader run after, unpatched);
    what it picks (a KV-cache dtype, backends) holds no weights."""
    from unittest import mock

    if "index_topk" not in config:
        return contextlib.nullcontext()
    return mock.patch("torch.cuda.get_device_capability", return_value=(9, 0))  # a Hopper's: its bf16 KV cache


def build_model(model_dir: str):
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.model_loader import get_model
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    # fp32 for exact comparisons; an FP8 checkpoint's layers run in bf16 (SGLang's Fp8Config refuses fp32)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    quantized = "quantization_config" in config
    # No request is served (no radix cache needed), and SGLang refuses a DeltaNet hybrid's radix cache on the CPU
    args = ServerArgs(model_path=model_dir, device="cpu", dtype="bfloat16" if quantized else "float32",
                      load_format="dummy", attention_backend=BUILD_ATTENTION.get(config["architectures"][0],
                                                                                 "torch_native"),
                      skip_tokenizer_init=True, disable_radix_cache=True)
    with _device_capability(config):  # publish resolves the server args (``resolve_once``): their hooks run here
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))  # the last one wins
    if not torch.distributed.is_initialized():
        init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        initialize_model_parallel()
    initialize_dp_attention(server_args=args)
    model_config = ModelConfig.from_server_args(args)
    hf_config = getattr(model_config.hf_config, "text_config", model_config.hf_config)  # a wrapper's: its RoPE
    rope = getattr(hf_config, "rope_parameters", None)
    if rope is None:  # SGLang's own Qwen3NextConfig: rope_theta and rope_scaling (None: plain RoPE)
        rope = hf_config.rope_parameters = {"rope_type": "default", "rope_theta": hf_config.rope_theta}
    if rope.get("rope_type", "default") == "default":
        # SGLang's CPU rope factory builds only DeepSeek's YaRN (get_rope_cpu asserts rope_scaling): plain RoPE as
        # YaRN of factor 1. RoPE holds no weights, so the parameters under test are unchanged.
        rope.update(rope_type="yarn", factor=1.0, original_max_position_embeddings=hf_config.max_position_embeddings)
    return get_model(model_config=model_config, load_config=LoadConfig(load_format="dummy"),
                     device_config=DeviceConfig(device="cpu"))


def file_weights(model_dir: str):
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    return safetensors_weights_iterator(sorted(str(p) for p in Path(model_dir).glob("*.safetensors")))


def _weights(call, model_dir: str):
    """One ``load_weights`` call's (name, tensor) pairs, unpacked by SGLang's own code where it unpacks them."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    if call == "files":
        return file_weights(model_dir)
    if isinstance(call, tuple) and call[0] == "files":  # another directory (a disk sync's)
        return file_weights(call[1])
    if isinstance(call, tuple) and call[0] == "distributed":  # the receive side of a flattened broadcast
        _, names, dtypes, shapes, payload = call
        bucket = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
        bucket.get_flattened_tensor().copy_(payload)  # what the broadcast writes into it
        return bucket.reconstruct_tensors()
    if isinstance(call, dict):  # update_weights_from_tensor's flattened bucket
        metadata = [FlattenedTensorMetadata(m.name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel)
                    for m in call["metadata"]]
        return FlattenedTensorBucket(flattened_tensor=call["flattened_tensor"], metadata=metadata).reconstruct_tensors()
    return call


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@torch.no_grad()
def run_load(model, model_dir: str, calls: list) -> dict:
    for param in model.parameters():
        param.fill_(float("nan"))
    captured = Captured()
    logging.getLogger("sglang").addHandler(captured)
    try:
        for call in calls:
            model.load_weights(_weights(call, model_dir))
    finally:
        logging.getLogger("sglang").removeHandler(captured)
    out = {"params": {name: p.detach().clone() for name, p in model.named_parameters()}, "routing_bias": {},
           "w_kc": {}, "w_vc": {}, "warnings": captured.messages}
    for i, layer in enumerate(model.model.layers):
        moe = getattr(layer, "mlp", None)
        if moe is None:  # MiniMax-M2's layers hold their MoE as block_sparse_moe
            moe = getattr(layer, "block_sparse_moe", None)
        topk = getattr(moe, "topk", None)
        if topk is not None and topk.topk_config.correction_bias is not None:  # sigmoid routers
            out["routing_bias"][i] = topk.topk_config.correction_bias.detach().clone()
        for key in ("w_kc", "w_vc"):
            if hasattr(getattr(layer, "self_attn", None), key):  # MLA only (Qwen3-Next's layers hold no self_attn)
                out[key][i] = getattr(layer.self_attn, key).detach().clone()
    return out


def main(*args: str) -> None:
    for model_dir, loads_path, out_path in zip(args[::3], args[1::3], args[2::3], strict=True):
        model = build_model(model_dir)
        loads = torch.load(loads_path, weights_only=False)
        results = {name: run_load(model, model_dir, calls) for name, calls in loads.items()}
        torch.save({"class": type(model).__name__, "loads": results}, out_path)
        del model


if __name__ == "__main__":
    main(*sys.argv[1:])
