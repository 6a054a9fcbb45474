"""What a run left on disk, for tests that compare runs."""

from __future__ import annotations

import torch


def final_weights(*checkpoints: str, optimizer: bool = False) -> list[dict]:
    """Each dist checkpoint's model tensors (RNG and, unless ``optimizer``, optimizer state left out), by flattened
    key."""
    from megatron.core import dist_checkpointing

    def flat(tree, prefix=""):
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            elif torch.is_tensor(value):
                out[f"{prefix}{key}"] = value
        return out

    return [{k: v for k, v in flat(dist_checkpointing.load_plain_tensors(c)).items()
             if not k.startswith(("rng_state",) if optimizer else ("optimizer", "rng_state"))} for c in checkpoints]
