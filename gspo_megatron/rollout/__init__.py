"""Rollouts: groups of G sampled responses per prompt with token ids and log-probs, from SGLang (or in-process
transformers), and weight sync into the servers after each update: the engines. What a response is rewarded for
and how a multi-turn episode unfolds is ``rewards``' (that package imports this one, never the other way round).

- ``types``: ``SamplingParams``, ``Sample``, ``Group``, ``SyncStats``, the ``RolloutEngine`` interface
  (``generate(prompts, n, sampling) -> list[Group]``, ``update_weights(named_tensors, version)``).
- ``sglang_engine.SGLangEngine`` (config: ``config.SGLangConfig``): launches and owns servers (``server``), or
  attaches to URLs / an sglang-router; health checks, concurrent requests, bounded retries (``client``), clear
  errors on a dead or hung server (``errors``).
- ``weight_sync``: distributed broadcast (bucketed, ``flattened_bucket``) or disk, from an iterator of
  ``(hf_name, tensor)``; ``process_group``: the trainer's end of the sync group.
- ``colocate``: servers on the trainer's GPUs: memory released / resumed around the update, weights as tensor
  handles through ``update_weights_from_tensor`` (``weight_sync.method="tensor"``).
- ``local_engine.LocalEngine``: the same interface on a transformers model in this process.
- ``batch.samples_to_batch``: samples -> token-aligned trainer tensors; ``mismatch.logprob_mismatch``: the
  train/inference log-prob gap, a metric for every step.
- ``hf_weights``: a transformers model's weights as checkpoint-named tensors (and back).

Nothing here imports sglang: servers are separate processes (``patches.sglang_cpu`` stands in for what they
miss on CPU).
"""

from .batch import samples_to_batch
from .config import SGLangConfig, WeightSyncConfig
from .errors import (BadResponse, RequestFailed, RewardError, RolloutError, ServerDied, ServerStartError,
                     ServerUnresponsive, StaleWeights, TooManyRestarts, WeightSyncError)
from .local_engine import LocalEngine
from .mismatch import logprob_mismatch
from .sglang_engine import SGLangEngine
from .types import Group, RolloutEngine, Sample, SamplingParams, SyncStats, flatten

__all__ = [
    "BadResponse", "Group", "LocalEngine", "RequestFailed", "RewardError", "RolloutEngine",
    "RolloutError", "SGLangConfig", "SGLangEngine", "Sample", "SamplingParams", "ServerDied", "ServerStartError",
    "ServerUnresponsive", "StaleWeights", "SyncStats", "TooManyRestarts", "WeightSyncConfig", "WeightSyncError",
    "flatten", "logprob_mismatch", "samples_to_batch",
]
