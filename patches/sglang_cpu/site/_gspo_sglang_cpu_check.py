"""Shared by the stand-ins: they exist for sglang 0.5.23 on CPU only (see patches/sglang_cpu/__init__.py)."""

from importlib.metadata import PackageNotFoundError, version

SUPPORTED = "0.5.23"


def require_supported_sglang(stand_in: str) -> None:
    try:
        found = version("sglang")
    except PackageNotFoundError:
        found = None
    if found != SUPPORTED:
        raise ImportError(
            f"patches/sglang_cpu: the {stand_in} stand-in is written for sglang=={SUPPORTED} on CPU, found "
            f"sglang {found}. Check what that version needs from {stand_in} and update the stand-in, or remove "
            "patches/sglang_cpu/site from PYTHONPATH (on a GPU machine install the real package)."
        )
