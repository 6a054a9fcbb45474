"""Megatron model checkpoints: torch_dist weights plus what it takes to rebuild the model.

A checkpoint directory holds

    metadata.json, .metadata, *.distcp, common.pt   megatron-core dist_checkpointing (torch_dist) files:
                                                    the model's ShardedTensors, loadable under any layout
    gspo_megatron.json                              format, ModelSpec, padded vocab size, HF dtypes,
                                                    the layout it was saved from
    hf/                                             the HF config.json, generation config and tokenizer files

A training checkpoint (train/records/checkpoint.py: ``checkpoint.dir/step_N/``) is one too, with optimizer, schedule and
trainer state beside the model's tensors; wherever a checkpoint is read, ``resolve`` also accepts the training run's
``latest`` pointer and its checkpoint dir (meaning its latest step).

Only tensors are saved (no ``_extra_state`` ShardedObjects): they are empty for the local spec and
layout-specific for TE, and a tensors-only checkpoint loads into either spec. Keys are per layer
(``decoder.layers.{i}.…``, megatron's ``non_homogeneous_layers``) for every family: MoE models with dense
layers get them from megatron anyway, and per-layer keys make a checkpoint of a different depth fail with the
missing or unexpected layers named, not with a shape mismatch of a stacked [num_layers, …] tensor.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.parallel.groups import Layout

from .errors import MappingError, listing
from .hf_config import ModelSpec
from .hidden_output import unwrap

FORMAT = "gspo-megatron/megatron-checkpoint/1"
METADATA_FILE = "gspo_megatron.json"
HF_DIR = "hf"
SHARDED_STATE_DICT_METADATA = {"non_homogeneous_layers": True}
# A training checkpoint (train/records/checkpoint.py) holds the same model tensors plus megatron's optimizer state, whose
# keys all start with this ("chained_N.optimizer." for MoE models' chained optimizers): it converts as it is, and
# only model-like keys count as unexpected.
NON_MODEL_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")
LATEST = "latest"  # a training run's checkpoint dir: the file naming its newest complete step dir


@dataclass
class CheckpointInfo:
    spec: ModelSpec
    padded_vocab_size: int
    dtype: str  # the Megatron parameters' dtype
    hf_dtypes: dict[str, str] = field(default_factory=dict)  # HF tensors whose dtype differs from ``dtype``
    saved_layout: dict = field(default_factory=dict)
    format: str = FORMAT

    def to_json(self) -> str:
        data = asdict(self)
        data["spec"] = self.spec.to_dict()
        return json.dumps(data, indent=2) + "\n"


def _pointed(path: Path) -> Path | None:
    """The step dir a training run's ``latest`` names (``path`` the file itself or the dir holding it), or None."""
    pointer = path / LATEST if path.is_dir() else path
    if pointer.name != LATEST or not pointer.is_file():
        return None
    target = pointer.parent / pointer.read_text().strip()
    if not (target / METADATA_FILE).is_file():
        raise FileNotFoundError(f"{pointer} names {target.name}, which is not a complete checkpoint "
                                f"(no {target / METADATA_FILE}): the checkpoint dir was edited")
    return target


def resolve(path: str | Path) -> Path:
    """The checkpoint dir ``path`` means: a checkpoint (a converted model or a training step dir), a training run's
    ``latest`` file, or its checkpoint dir (its latest step)."""
    path = Path(path)
    # Ours (METADATA_FILE), or a bare dist checkpoint of save_weights (megatron's own marker file, the one
    # dist_checkpointing.check_is_distributed_checkpoint looks for).
    if (path / METADATA_FILE).is_file() or (path / "metadata.json").is_file():
        return path
    if not path.exists():
        raise FileNotFoundError(f"the Megatron checkpoint {path} does not exist")
    target = _pointed(path)
    if target is None:
        raise FileNotFoundError(f"{path} is not a gspo-megatron checkpoint: no {METADATA_FILE} and no {LATEST} "
                                "file (give a checkpoint.dir, its step_N dir or its latest; or convert an HF model "
                                "with tools/convert_hf_to_megatron.py)")
    return target


def is_megatron_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory`` is (or, like ``resolve``, points at) a Megatron checkpoint rather than an HF model."""
    path = Path(directory)
    return (path / METADATA_FILE).is_file() or (path / LATEST).is_file() or path.name == LATEST


def read_info(directory: str | Path) -> CheckpointInfo:
    file = resolve(directory) / METADATA_FILE
    data = json.loads(file.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{file}: format {data.get('format')!r}, expected {FORMAT!r}")
    data["spec"] = ModelSpec.from_dict(data["spec"])
    return CheckpointInfo(**data)


def write_info(directory: str | Path, info: CheckpointInfo) -> None:
    (Path(directory) / METADATA_FILE).write_text(info.to_json())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={name!r} is not a torch dtype")
    return value


def layout_dict(layout: Layout) -> dict:
    return asdict(layout)


# ---- sharded state dicts ---------------------------------------------------------------------------


def tensors_state_dict(model):
    """The model's sharded state dict without ShardedObjects (``_extra_state``). Fresh on every call:
    dist_checkpointing consumes the tensor factories it is given."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    def strip(node):
        return {k: strip(v) if isinstance(v, dict) else v for k, v in node.items() if not isinstance(v, ShardedObject)}

    # A fresh dict each time: megatron adds the current data-parallel group to it in place.
    return strip(unwrap(model).sharded_state_dict(metadata=dict(SHARDED_STATE_DICT_METADATA)))


def _sharded_tensors(sharded_state_dict):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded_state_dict)
    stack = [sharded_state_dict]
    while stack:
        node = stack.pop()
        values = node.values() if isinstance(node, dict) else node
        for value in values:
            if isinstance(value, ShardedTensor):
                yield value
            elif isinstance(value, (dict, list, tuple)):
                stack.append(value)


def save_weights(model, directory: str | Path) -> None:
    """torch_dist save of this rank's shards (collective: every rank of the model calls it)."""
    from megatron.core import dist_checkpointing

    from patches import megatron_checkpoint_writer

    megatron_checkpoint_writer.apply()  # the writer's helper process dies with this rank, even SIGKILLed
    dist_checkpointing.save(tensors_state_dict(model), str(directory))


def check_weights(model, directory: str | Path) -> None:
    """Before loading: the checkpoint holds exactly the tensors the model needs, with their global shapes.

    Collective. Raises ``MappingError`` naming missing, unexpected and mis-shaped Megatron tensors
    (megatron-core itself would load a mis-shaped tensor silently or fail deep inside torch). Optimizer
    state (``NON_MODEL_KEY``) is not unexpected: training checkpoints convert as they are.
    """
    from megatron.core import dist_checkpointing

    directory = resolve(directory)
    stored = {key: tuple(t.global_shape) for key, t in dist_checkpointing.load_tensors_metadata(str(directory)).items()}
    needed = {t.key: tuple(t.global_shape) for t in _sharded_tensors(tensors_state_dict(model))}
    # Every rank judges the union of all ranks' needs, so all raise together (none is left in a collective).
    every_rank = [needed]
    if dist.get_world_size() > 1:
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, needed)
    for other in every_rank:
        needed.update(other)
    problems = []
    missing = set(needed) - set(stored)
    if missing:
        problems.append(listing("missing tensors", missing))
    unexpected = {key for key in set(stored) - set(needed) if not NON_MODEL_KEY.match(key)}
    if unexpected:
        problems.append(listing("unexpected tensors", unexpected))
    wrong = [f"{k} has shape {list(stored[k])}, the model needs {list(needed[k])}"
             for k in sorted(set(needed) & set(stored)) if stored[k] != needed[k]]
    if wrong:
        problems.append(f"shape mismatches ({len(wrong)}): " + "; ".join(wrong[:8]))
    if problems:
        raise MappingError(f"the Megatron checkpoint {directory} does not match the model:\n  - "
                           + "\n  - ".join(problems))


def load_weights(model, directory: str | Path) -> None:
    """Load a checkpoint's tensors into this rank's model, resharding to its layout (collective)."""
    from megatron.core import dist_checkpointing

    directory = resolve(directory)
    check_weights(model, directory)
    template = tensors_state_dict(model)
    loaded = dist_checkpointing.load(template, str(directory))
    # A training checkpoint's common state (optimizer param groups, scheduler, trainer state) comes back too.
    loaded = {k: v for k, v in loaded.items() if k in template}
    missing, unexpected = unwrap(model).load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise MappingError(f"loading {directory}: " + "; ".join(
            s for s in (listing("not loaded", missing) if missing else "",
                        listing("unexpected", unexpected) if unexpected else "") if s))
