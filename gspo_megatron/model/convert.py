"""Checkpoint conversion, HF safetensors <-> Megatron torch_dist, through the bridge.

``hf_to_megatron``: every rank builds its part of the Megatron model under the requested layout, fills it
from the HF files (reading only its own slices) and the ranks save one torch_dist checkpoint together;
dist_checkpointing reshards it to any other layout at load. ``megatron_to_hf``: build the model (any layout
the checkpoint fits, world=1 by default), load with resharding, export full HF tensors through the bridge;
one rank per pipeline stage writes that stage's shards, rank 0 names them and writes the index.

Everything checkable is checked before a process group starts (config family and fields, the HF tensor set
and shapes, the layout against the model and world size, the output path); everything is written into a
temporary directory renamed at the end (``atomic.atomic_output_dir``). Dtypes are kept: the Megatron
parameters take the HF tensors' dtype (the widest, if they differ, with the others recorded so the way back
restores each), so HF -> Megatron -> HF is bit for bit; the router's correction bias comes back fp32 (the engine
keeps it so, and training may move it: ``mapping.export_dtype``), equal in value to a bf16 one.

Multi-token-prediction layers (DeepSeek-V3 / GLM-4.5 ``num_nextn_predict_layers``, stored as decoder layers after
the last: ``mapping.mtp_layer_of``) are not part of the policy and never trained: ``hf_to_megatron`` copies them
beside the checkpoint (``mtp/``, safetensors) and ``megatron_to_hf`` writes them back unchanged (an FP8 checkpoint's
dequantized, as all its weights), so an exported checkpoint still serves SGLang's NEXTN speculative decoding.
A checkpoint without them (every transformers re-save) converts too. A multimodal checkpoint's tensors outside its
language model (Kimi-K2.5's vision tower and projector: ``mapping.is_carried``) are carried the same way, untrained.

Both run in one process (world of one) or under torchrun (``parallel.groups.init_distributed``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.parallel.groups import Layout

from . import checkpoint, fp8, hf_files
from .atomic import atomic_output_dir, check_output_dir
from .bridge import Bridge
from .errors import MappingError, listing
from .hf_config import load_config_json, read_hf_config, serving_config, spec_differences
from .layout_check import check_layout
from .mapping import KEPT_FP32, export_dtype, is_carried, is_ignored
from .process_groups import ensure_model_parallel
from .provider import build_gpt_model

MTP_DIR = "mtp"  # beside the torch_dist files: the HF checkpoint's MTP layers, unchanged
_WIDTH = {torch.float64: 3, torch.float32: 2, torch.bfloat16: 1, torch.float16: 1}


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _log(message: str) -> None:
    if _rank() == 0:
        print(f"[convert] {message}", file=sys.stderr, flush=True)


def model_dtype(dtypes: dict[str, torch.dtype]) -> torch.dtype:
    """The dtype to build the Megatron model in: the HF tensors' one, or the widest if they differ. The sigmoid
    router's fp32 ``e_score_correction_bias`` in a bf16 checkpoint does not count: megatron keeps it fp32 anyway
    (``mapping.KEPT_FP32``)."""
    kinds = {d for n, d in dtypes.items() if not n.endswith(KEPT_FP32)} or set(dtypes.values())
    unknown = [d for d in kinds if d not in _WIDTH]
    if unknown:
        names = [n for n, d in dtypes.items() if d in unknown]
        title = f"tensors of unsupported dtype {unknown[0]} (quantised checkpoints are not mapped)"
        raise MappingError(listing(title, names))
    return max(kinds, key=_WIDTH.__getitem__)


def hf_to_megatron(hf_dir: str | Path, out: str | Path, layout: Layout = Layout(),
                   dtype: torch.dtype | None = None) -> Path:
    """Convert an HF directory into a Megatron checkpoint at ``out`` (see the module docstring)."""
    started = time.perf_counter()
    hf_dir, out = Path(hf_dir), Path(out).absolute()
    source = hf_files.open_hf_dir(hf_dir)  # FP8 block-scaled weights dequantized on read (model.fp8)
    spec = read_hf_config(hf_dir).named_as(source.shapes())
    bridge = Bridge(spec)
    bridge.check_hf_tensors(source.shapes())
    mtp = [n for n in source.shapes() if is_carried(spec, n)]  # MTP layers, a vision tower
    dtypes = {n: d for n, d in source.dtypes().items() if not is_ignored(n) and n not in mtp}
    build_dtype = dtype or model_dtype(dtypes)
    check_layout(spec, layout, _world_size(), padded_vocab_size=bridge.padded_vocab_size)
    check_output_dir(out)
    ensure_model_parallel(layout)
    with atomic_output_dir(out) as tmp:
        model = build_gpt_model(spec, layout, dtype=build_dtype, padded_vocab_size=bridge.padded_vocab_size)
        bridge.load_hf_weights(model, source)
        checkpoint.save_weights(model, tmp)
        if _rank() == 0:
            info = checkpoint.CheckpointInfo(
                spec=spec, padded_vocab_size=bridge.padded_vocab_size, dtype=checkpoint.dtype_name(build_dtype),
                hf_dtypes={n: checkpoint.dtype_name(d) for n, d in sorted(dtypes.items()) if d != build_dtype},
                saved_layout=checkpoint.layout_dict(layout))
            checkpoint.write_info(tmp, info)
            hf_files.copy_hf_metadata(hf_dir, tmp / checkpoint.HF_DIR)
            if mtp:  # tensor by tensor into shards: never the whole MTP layer in memory at once
                (tmp / MTP_DIR).mkdir()
                hf_files.write_safetensors(((n, source.read(n)) for n in mtp), tmp / MTP_DIR)
    _log(f"{hf_dir} -> {out}: {len(dtypes)} HF tensors, {source.total_bytes() / 1e9:.3f} GB, "
         f"{time.perf_counter() - started:.1f} s")
    return out


def _is_stage_writer() -> bool:
    """One rank per pipeline stage writes that stage's tensors (every rank holds them after export)."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0


def megatron_to_hf(megatron_dir: str | Path, out: str | Path, hf_config_dir: str | Path | None = None,
                   layout: Layout = Layout(), max_shard_bytes: int = 5 * 10**9,
                   fp8_block: tuple[int, int] | None = None, fp8_keep_layers: int = 0) -> Path:
    """Convert a Megatron checkpoint back to HF safetensors + config + tokenizer files at ``out``.

    ``hf_config_dir`` supplies config.json and the tokenizer files (default: the copy stored in the
    checkpoint); it must describe the model the checkpoint was converted from. With ``fp8_block`` the linear weights
    of the decoder layers (``fp8.Fp8Scheme``: all but the first and last ``fp8_keep_layers``) are written block-FP8
    in blocks of that size (each cast to its HF dtype first, then ``fp8.quantize``d, one tensor at a time) and
    config.json gets the matching ``quantization_config``: a checkpoint SGLang serves in FP8.
    """
    from megatron.core import parallel_state as ps

    started = time.perf_counter()
    megatron_dir, out = checkpoint.resolve(megatron_dir), Path(out).absolute()  # a step dir, latest, checkpoint.dir
    info = checkpoint.read_info(megatron_dir)
    config_dir = Path(hf_config_dir) if hf_config_dir else megatron_dir / checkpoint.HF_DIR
    # Where the text model's tensors sit (hf_config.RESAVED_UNDER) is the checkpoint's: config_dir holds no tensors
    # to tell.
    spec = replace(read_hf_config(config_dir), text_model_prefix=info.spec.text_model_prefix)
    differences = spec_differences(spec, info.spec)
    if differences:
        raise MappingError(f"{config_dir / 'config.json'} describes a different model than the checkpoint "
                           f"{megatron_dir} (config vs checkpoint): " + "; ".join(differences))
    check_layout(spec, layout, _world_size(), padded_vocab_size=info.padded_vocab_size)
    check_output_dir(out)
    ensure_model_parallel(layout)
    bridge = Bridge(spec, info.padded_vocab_size)
    fp8_scheme = fp8.Fp8Scheme(spec.num_layers, fp8_block, fp8_keep_layers) if fp8_block else None
    with atomic_output_dir(out) as tmp:
        model = build_gpt_model(spec, layout, dtype=checkpoint.torch_dtype(info.dtype),
                                padded_vocab_size=info.padded_vocab_size)
        checkpoint.load_weights(model, megatron_dir)
        writer = hf_files.ShardWriter(tmp, prefix=f"stage{ps.get_pipeline_model_parallel_rank()}",
                                      max_shard_bytes=max_shard_bytes)
        writes = _is_stage_writer()
        default_dtype = checkpoint.torch_dtype(info.dtype)
        mtp = hf_files.open_hf_dir(megatron_dir / MTP_DIR) if (megatron_dir / MTP_DIR).is_dir() else None
        if mtp is not None and _rank() == 0:  # rank 0 writes stage 0's shards
            for name in mtp.shapes():
                writer.add(name, mtp.read(name))
        def in_hf_dtypes():
            for name, tensor in bridge.export_hf_weights(model):
                # Back to each tensor's HF dtype: megatron keeps some parameters wider than params_dtype
                # (torch norms stay fp32 in a bf16 model), which holds the bf16 values exactly. The router's bias
                # stays fp32 whatever the checkpoint held (mapping.export_dtype): training may have moved it.
                wanted = info.hf_dtypes.get(name)
                dtype = checkpoint.torch_dtype(wanted) if wanted else default_dtype
                yield name, tensor.to(export_dtype(name, tensor, dtype))

        exported = in_hf_dtypes()
        if fp8_scheme is not None:
            exported = fp8.quantized_stream(exported, fp8_scheme)
        for name, tensor in exported:
            if writes:
                writer.add(name, tensor)
        shards = writer.finish() if writes else []
        every_rank = [shards]
        if dist.get_world_size() > 1:
            every_rank = [None] * dist.get_world_size()
            dist.all_gather_object(every_rank, shards)
        if _rank() == 0:
            shards = sorted((s for rank_shards in every_rank for s in rank_shards), key=lambda s: _stage_order(s[0]))
            written = {name for _, names, _ in shards for name in names}
            expected = set(bridge.hf_tensor_shapes()) | set(mtp.shapes() if mtp is not None else ())
            if fp8_scheme is not None:
                expected |= {n + fp8.SCALE_SUFFIX for n, shape in bridge.hf_tensor_shapes().items()
                             if fp8_scheme.quantizes(n, shape)}
            if written != expected:
                raise MappingError("export wrote a different tensor set than the mapping: "
                                   + listing("missing", expected - written) + "; "
                                   + listing("extra", written - expected))
            hf_files.finalize_shards(tmp, shards)
            hf_files.copy_hf_metadata(config_dir, tmp)
            config = load_config_json(tmp)
            exported = hf_files.dequantized_config(config)  # bf16 weights now
            exported = serving_config(exported)  # what SGLang reads, as the family's releases hold it
            if fp8_scheme is not None:
                exported = fp8_scheme.config(exported)
            if exported != config:
                (tmp / "config.json").write_text(json.dumps(exported, indent=2))
    _log(f"{megatron_dir} -> {out}: {len(bridge.hf_tensor_shapes())} HF tensors, "
         f"{time.perf_counter() - started:.1f} s")
    return out


def _stage_order(file: str) -> tuple[int, str]:
    stage = file.removeprefix("stage").split("-", 1)[0]
    return int(stage), file
