"""GSPO training backend for Megatron-Core policies with SGLang rollouts."""

__version__ = "0.1.0"

import warnings as _warnings

# megatron-core warns four times on import that TransformerEngine and apex are missing; environment.note_fallbacks
# says it once, in our words, when a model is built.
_warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
# megatron-core 0.19 also warns at import that absl-py (an optional logging backend) is missing.
_warnings.filterwarnings("ignore", message="absl.logging is not installed", category=UserWarning)
