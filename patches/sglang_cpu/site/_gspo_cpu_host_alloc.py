"""Plain host buffers for SGLang on a CPU device (sglang 0.5.23).

``pool_host.common.ALLOC_MEMORY_FUNCS`` maps a device to its host-buffer allocator; "cpu" falls to the default,
``alloc_with_host_register``, which pins the buffer and calls cudaHostRegister: "Torch not compiled with CUDA
enabled" on a CPU-only torch. The routed-experts capturer (``--enable-return-routed-experts``) allocates its host
cache through it, so without this a CPU server with routed-experts capture dies at start-up. On CPU the "device"
and the host are the same memory: pinning has nothing to do.
"""

from __future__ import annotations


def alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return allocator.allocate(dims, dtype=dtype, device=device)


def install(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unpinned
