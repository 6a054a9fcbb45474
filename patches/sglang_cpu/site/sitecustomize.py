"""Runs at start-up in every process of a CPU SGLang server (this folder leads its PYTHONPATH, see
patches/sglang_cpu): patches sglang modules when sglang imports them. Nothing is imported eagerly; for any
sglang but 0.5.23 nothing is patched.

- ``torch_native_backend``: ``_gspo_batched_decode`` batches the decode attention.
- ``pool_host.common``: host buffers on a CPU device are plain memory (``_gspo_cpu_host_alloc``): the default
  allocator pins and cudaHostRegisters them, which fails without CUDA. The routed-experts capture
  (``--enable-return-routed-experts``, rollout routing replay) allocates its host cache this way.
- the modules of the Triton kernels the gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next) run: pure-torch stand-ins
  (``_gspo_gated_deltanet``), bound where sglang defines each kernel, before its GDN backend and models import it.
- ``layers.quantization.fp8``: block-FP8 linear and expert layers (FP8 rollouts, ``rollout.fp8``) compute through a
  torch stand-in of SGLang's W8A8 block GEMM (``_gspo_fp8_block``): SGLang runs that GEMM on GPUs or AMX CPUs only.
- ``entrypoints.engine``: the scheduler and detokenizer processes are forked, not spawned (``_gspo_fork_children``):
  a spawned child imports sglang, torch and transformers again, two thirds of a CPU server's start.
"""

import importlib.abc
import importlib.util
import sys


def _batched_decode(module):
    import _gspo_batched_decode

    _gspo_batched_decode.install(module.TorchNativeAttnBackend)


def _cpu_host_alloc(module):
    import _gspo_cpu_host_alloc

    _gspo_cpu_host_alloc.install(module)


def _gated_deltanet(module):
    import _gspo_gated_deltanet

    _gspo_gated_deltanet.install(module)


def _fp8_block(module):
    import _gspo_fp8_block

    _gspo_fp8_block.install(module)


def _fork_children(module):
    import _gspo_fork_children

    _gspo_fork_children.install(module)


_GATED_DELTANET_MODULES = (
    "sglang.kernels.ops.mamba.causal_conv1d_triton", "sglang.kernels.ops.attention.linear.fused_gdn_gating",
    "sglang.kernels.ops.attention.fla.chunk", "sglang.kernels.ops.attention.fla.fused_recurrent",
    "sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent",
    "sglang.kernels.ops.attention.triton_gdn_fused_proj", "sglang.kernels.ops.elementwise.elementwise",
    "sglang.kernels.ops.attention.fla.layernorm_gated", "sglang.kernels.ops.attention.fla.fused_norm_gate",
)  # _gspo_gated_deltanet.STAND_INS and NORMS (not imported here: it imports torch)

_TARGETS = {
    **{name: _gated_deltanet for name in _GATED_DELTANET_MODULES},
    "sglang.srt.entrypoints.engine": _fork_children,
    "sglang.srt.layers.quantization.fp8": _fp8_block,
    "sglang.srt.layers.attention.torch_native_backend": _batched_decode,
    "sglang.srt.mem_cache.pool_host.common": _cpu_host_alloc,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        patch = _TARGETS.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            from importlib.metadata import version

            if version("sglang") == "0.5.23":
                patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
