"""Sampling: each step's rollout, identical on every rank. Rank 0 owns the engine, generates, scores and (with
dynamic sampling) draws more prompts; the rollout source decides when (sync, one_step_off, async) and carries
partial rollouts across steps."""
