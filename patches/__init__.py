"""Named, version-checked changes to third-party packages, each applied explicitly.

- ``patches.megatron_cpu``: megatron-core 0.16.1 on CPU with gloo (``apply()``; no-op when CUDA is present).
- ``patches.sglang_cpu``: sglang 0.5.23 serving on CPU: stand-ins for ``vllm._custom_ops`` (a pure-torch rotary
  op) and ``torchvision``, put on the server process's PYTHONPATH only (``server_env(env, device="cpu")``).
"""
