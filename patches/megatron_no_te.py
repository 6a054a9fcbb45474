"""megatron-core without TransformerEngine, on any device: the MoE router's ``te_general_gemm`` is defined.

megatron-core 0.16.1's ``transformer/moe/moe_utils.py`` names ``te_general_gemm`` only inside its TransformerEngine
import; ``RouterGatingLinearFunction.forward`` reads it on every router call (``if te_general_gemm is not None``), so
without TE the first MoE forward raises ``NameError``, on a GPU as on the CPU. ``apply()`` defines it as ``None``
there, which is what 0.19.2 does itself (its import's ``else`` branch): the router then runs ``torch.matmul``.

Applied explicitly where a model is built without TE (``model.provider.megatron_patches``), whatever the device;
``patches.megatron_cpu`` applies it too (CPU runs never have TE). Versions:

- ``APPLIES_TO`` (0.16.1): defined when missing;
- ``DEFINES_IT`` (0.19.2): nothing to do, ``apply()`` returns False;
- a module that already has the name (TE imported) is left alone, whatever the version;
- any other version missing the name is refused, naming the tested ones.
"""

from __future__ import annotations

APPLIES_TO = ("0.16.1",)
DEFINES_IT = ("0.19.2",)  # moe_utils sets te_general_gemm = None without TE


class MegatronVersionError(RuntimeError):
    pass


def installed_version() -> str:
    from megatron.core import package_info

    return package_info.__version__.split("+")[0]  # 0.19 appends "+<git hash>" of an enclosing repository


def apply(moe_utils=None, version: str | None = None) -> bool:
    """Define ``moe_utils.te_general_gemm = None`` where megatron left it undefined. Idempotent.

    ``moe_utils`` and ``version`` default to the installed module and release (tests pass a freshly imported module).
    Returns whether it changed anything.
    """
    if moe_utils is None:
        from megatron.core.transformer.moe import moe_utils
    version = version or installed_version()
    if hasattr(moe_utils, "te_general_gemm"):
        return False  # TE imported, or a release that defines it (DEFINES_IT)
    if version not in APPLIES_TO:
        raise MegatronVersionError(
            f"patches.megatron_no_te: megatron-core {version}'s moe_utils has no te_general_gemm without "
            f"TransformerEngine, and this patch was written for {', '.join(APPLIES_TO)} (while "
            f"{', '.join(DEFINES_IT)} define it themselves): install one of those, or TransformerEngine"
        )
    moe_utils.te_general_gemm = None
    return True
