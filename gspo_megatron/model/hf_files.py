"""Hugging Face checkpoint files: lazy safetensors reading, sharded writing with an index, metadata copies.

``open_hf_tensors(source)`` gives a ``TensorSource`` (names, shapes, dtypes, ``read(name, index)``) over an
HF directory (``model.safetensors`` or shards with ``model.safetensors.index.json``) or an in-memory dict.
Reads take an index so a rank loads only its shard's rows or columns (safetensors slices the file).

``open_hf_dir`` is the one way to open an HF directory: the load, the converters, ``score`` and every pre-flight
check read a checkpoint through it, so they see the same tensors (a block-scaled FP8 checkpoint's scales hidden,
its weights dequantized). ``SafetensorsDir`` is the raw file reader beneath it. What loads an HF directory by
itself (transformers, an SGLang server) gets ``plain_copy`` of an FP8 one: the same tensors, written out.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import torch

from . import fp8, gpt_oss
from .atomic import replaced_dir
from .tensor_source import TensorSource

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class DictSource(TensorSource):
    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = tensors

    def shapes(self):
        return {k: tuple(v.shape) for k, v in self._tensors.items()}

    def dtypes(self):
        return {k: v.dtype for k, v in self._tensors.items()}

    def read(self, name, index=None):
        tensor = self._tensors[name]
        return tensor if index is None else tensor[index]


class SafetensorsDir(TensorSource):
    """The safetensors files of an HF directory, read lazily (headers at open, data per ``read``)."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open

        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.directory}")
        self._handles = {}
        self._file_of: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        for file in files:
            path = self.directory / file
            if not path.is_file():
                raise FileNotFoundError(f"{INDEX_FILE} names {file}, which is not in {self.directory}")
            handle = safe_open(str(path), framework="pt")
            self._handles[file] = handle
            for name in handle.keys():
                if name in self._file_of:
                    raise ValueError(f"tensor {name} is in both {self._file_of[name]} and {file}")
                self._file_of[name] = file
                sl = handle.get_slice(name)
                self._shapes[name] = tuple(sl.get_shape())
                self._dtypes[name] = _DTYPES[sl.get_dtype()]

    def shapes(self):
        return dict(self._shapes)

    def dtypes(self):
        return dict(self._dtypes)

    def read(self, name, index=None):
        handle = self._handles[self._file_of[name]]
        if index is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[index]

    def total_bytes(self) -> int:
        return sum(_numel(s) * _itemsize(self._dtypes[n]) for n, s in self._shapes.items())


def tensor_names(directory: str | Path) -> list[str]:
    """The tensor names of an HF directory's safetensors files, from the index or the headers; none where it holds
    no weights (a Megatron checkpoint's copy of the config)."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    return list(SafetensorsDir(directory).shapes()) if any(directory.glob("*.safetensors")) else []


def open_hf_dir(directory: str | Path) -> TensorSource:
    """An HF directory's tensors as the model uses them: block-scaled FP8 weights (``fp8``) and gpt-oss's MXFP4
    experts (``gpt_oss``) dequantized on read."""
    source = SafetensorsDir(directory)
    config_file = Path(directory) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if gpt_oss.is_mxfp4(config):
        return gpt_oss.Mxfp4Source(source, config)
    return fp8.BlockFp8Source(source, config) if fp8.block_size(config) else source


def is_quantized(config: dict) -> bool:
    """The checkpoint's weights are read dequantized (block-scaled FP8, gpt-oss's MXFP4): what loads the directory by
    itself needs ``plain_copy``."""
    return gpt_oss.is_mxfp4(config) or bool(fp8.block_size(config))


def dequantized_config(config: dict) -> dict:
    """config.json for the weights as ``open_hf_dir`` reads them."""
    if gpt_oss.is_mxfp4(config):
        return gpt_oss.dequantized_config(config)
    return fp8.dequantized_config(config) if fp8.block_size(config) else config


def plain_copy(directory: str | Path, out: str | Path, announce=None) -> Path:
    """``directory`` as ``open_hf_dir`` reads it, written to ``out``: a block-scaled FP8 checkpoint's weights
    dequantized to its dtype and its scales dropped, config.json without ``quantization_config``, the tokenizer and
    other files copied. For what loads a directory by itself and would build FP8 layers from it (transformers needs
    a GPU and accelerate for them; an SGLang server would serve FP8 while the trainer syncs the dequantized weights).
    Tensor by tensor (shards of at most 5 GB); ``out`` appears complete or not at all, and a complete copy already
    there is kept (a restarted run reuses it; one with another config.json, another model's, is replaced). One
    process writes it. ``announce(out)`` is called before a copy is written (not when one is kept)."""
    return _copy(directory, out, lambda tensors: tensors, dequantized_config, announce)


def quantized_copy(directory: str | Path, out: str | Path, scheme: fp8.Fp8Scheme, announce=None) -> Path:
    """``directory`` with the weights ``scheme`` names block-FP8, written to ``out``: what the servers of FP8
    rollouts start from (config.json ``fp8.quantized_dir_config``: SGLang builds FP8 layers, into which every
    weight sync loads the FP8 tensors it sends). Read as ``open_hf_dir`` reads it (an FP8 checkpoint dequantized,
    then quantized by ``scheme``: the trainer's weights), quantized tensor by tensor (``fp8.quantized_stream``); as
    ``plain_copy``, ``out`` appears complete or not at all and a complete copy of the same config.json is kept."""
    return _copy(directory, out, lambda tensors: fp8.quantized_stream(tensors, scheme),
                 lambda config: fp8.quantized_dir_config(dequantized_config(config), scheme), announce)


def _copy(directory: str | Path, out: str | Path, tensors, config_of, announce=None) -> Path:
    """``directory``'s tensors through ``tensors`` and its config.json through ``config_of``, written to ``out``
    (beside it, then renamed into place), with its other files; kept if complete already with that config.json
    (``announce(out)`` runs only when a copy is written: a copy of a large checkpoint takes minutes)."""
    directory, out = Path(directory), Path(out).absolute()
    config = config_of(json.loads((directory / "config.json").read_text()))
    if (out / "config.json").is_file():
        if json.loads((out / "config.json").read_text()) == config:
            return out
        shutil.rmtree(out)  # another model's or another quantization's copy
    if announce is not None:
        announce(out)
    source = open_hf_dir(directory)
    with replaced_dir(out) as tmp:
        copy_hf_metadata(directory, tmp)
        write_safetensors(tensors((name, source.read(name)) for name in source.shapes()), tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def open_hf_tensors(source) -> TensorSource:
    """A directory path, a {name: tensor} mapping or a TensorSource -> TensorSource."""
    if isinstance(source, TensorSource):
        return source
    if isinstance(source, Mapping):
        return DictSource(source)
    return open_hf_dir(source)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def parse_size(text: str | int) -> int:
    """'5GB' / '500MB' / '1024' -> bytes (decimal units, as transformers' max_shard_size)."""
    if isinstance(text, int):
        return text
    units = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    text = text.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _owning_cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself if it is a whole contiguous CPU storage, else a copy: safetensors refuses tensors that
    share storage (the export's q/k/v and gate/up parts are views of one fused parameter)."""
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    if tensor.device.type == "cpu" and tensor.is_contiguous() and whole and tensor.storage_offset() == 0:
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)


class ShardWriter:
    """Writes named tensors into safetensors files of at most ``max_shard_bytes`` each, under ``prefix``.

    ``finish()`` returns [(file name, [tensor names], bytes)]. File names are provisional
    (``{prefix}-{k}.safetensors``); ``finalize_shards`` renames them to transformers' names and writes the
    index. Views and device tensors are copied to the CPU as they arrive; other tensors are kept by reference
    until their shard is written, so they must not change before ``finish()``.
    """

    def __init__(self, directory: str | Path, prefix: str = "part", max_shard_bytes: int = 5 * 10**9):
        self.directory = Path(directory)
        self.prefix = prefix
        self.max_shard_bytes = max_shard_bytes
        self._current: dict[str, torch.Tensor] = {}
        self._bytes = 0
        self._written: list[tuple[str, list[str], int]] = []
        self._seen: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise ValueError(f"tensor {name} written twice")
        self._seen.add(name)
        size = tensor.numel() * tensor.element_size()
        if self._current and self._bytes + size > self.max_shard_bytes:
            self._flush()
        self._current[name] = _owning_cpu_tensor(tensor)
        self._bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        file = f"{self.prefix}-{len(self._written):05d}.safetensors"
        save_file(self._current, str(self.directory / file), metadata={"format": "pt"})
        self._written.append((file, list(self._current), self._bytes))
        self._current, self._bytes = {}, 0

    def finish(self) -> list[tuple[str, list[str], int]]:
        if self._current:
            self._flush()
        return self._written


def finalize_shards(directory: str | Path, shards: list[tuple[str, list[str], int]]) -> None:
    """Rename provisional shard files to ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + index."""
    directory = Path(directory)
    if len(shards) == 1:
        os.replace(directory / shards[0][0], directory / SINGLE_FILE)
        return
    weight_map, total = {}, 0
    for k, (file, names, size) in enumerate(shards, start=1):
        final = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        os.replace(directory / file, directory / final)
        weight_map.update({name: final for name in names})
        total += size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def write_safetensors(named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str | Path,
                      max_shard_bytes: int = 5 * 10**9) -> list[str]:
    """Write tensors as an HF safetensors checkpoint in ``directory`` (one file, or shards and an index)."""
    writer = ShardWriter(directory, max_shard_bytes=max_shard_bytes)
    for name, tensor in named_tensors:
        writer.add(name, tensor)
    shards = writer.finish()
    finalize_shards(directory, shards)
    return [name for _, names, _ in shards for name in names]


def copy_hf_metadata(source: str | Path, destination: str | Path) -> list[str]:
    """Copy an HF directory's config, generation config and tokenizer files (everything but weights)."""
    source, destination = Path(source), Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(source.iterdir()):
        if not path.is_file() or path.name == INDEX_FILE or path.name.endswith(WEIGHT_SUFFIXES):
            continue
        if path.name.startswith("."):
            continue
        shutil.copy2(path, destination / path.name)
        copied.append(path.name)
    return copied
