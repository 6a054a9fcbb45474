"""Stand-in for ``vllm`` inside a CPU SGLang 0.5.23 server: only ``vllm._custom_ops.rotary_embedding`` exists.

SGLang's rotary embedding imports it when neither CUDA nor its own CPU engine is in use (``--device cpu``).
"""

from _gspo_sglang_cpu_check import require_supported_sglang

require_supported_sglang("vllm")
