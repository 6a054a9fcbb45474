"""GSPO training backend for Megatron-Core policies with SGLang rollouts."""

__version__ = "0.1.0"
