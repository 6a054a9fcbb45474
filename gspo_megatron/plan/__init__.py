"""``gspo-megatron plan``: a run's parallel layout and per-GPU memory, before launching it (``layouts``), the memory
model it prints (``memory``), and the probe that checks that model against a measured step (``probe``). It reads the
trainer's config and, for the probe, builds the trainer's policy: it sits beside the loop, not under it."""
