"""Named, version-checked changes to third-party packages, each applied explicitly.

- ``patches.megatron_cpu``: megatron-core 0.16.1 on CPU with gloo (``apply()``; no-op when CUDA is present).
"""
