"""Named, version-checked changes to third-party packages, each applied explicitly.

- ``patches.megatron_cpu``: megatron-core 0.16.1 on CPU with gloo (``apply()``; no-op when CUDA is present).
- ``patches.megatron_no_te``: megatron-core 0.16.1 without TransformerEngine on any device: the MoE router's
  ``te_general_gemm`` is defined as None (``apply()``, by ``model.provider.build_gpt_model`` when TE is not used).
- ``patches.megatron_checkpoint_writer``: megatron-core 0.16.1 / 0.19.2's torch_dist checkpoint writer: its results
  queue's Manager process dies with the rank (``apply()``, by ``train.records.checkpoint.save``).
- ``patches.sglang_cpu``: sglang 0.5.23 serving on CPU: stand-ins for ``vllm._custom_ops`` (a pure-torch rotary
  op) and ``torchvision``, put on the server process's PYTHONPATH only (``server_env(env, device="cpu")``).
"""
