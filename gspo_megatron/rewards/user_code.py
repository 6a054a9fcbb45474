"""Loading what a user names in the config: a built-in by name, or ``module:attribute`` from an importable module."""

from __future__ import annotations

import importlib


def load_named(spec: str, builtin: dict, field: str, form: str, kind: str):
    """``builtin[spec]``, or ``attribute`` of ``module`` for ``spec = "module:attribute"`` (callable). Errors are
    ValueErrors naming ``field`` (e.g. "data.reward") and the expected ``form`` ("module:function") / ``kind``."""
    if spec in builtin:
        return builtin[spec]
    if ":" not in spec:
        raise ValueError(f"{field}={spec!r} is neither a built-in ({sorted(builtin)}) nor '{form}'")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{field}={spec!r}: cannot import module {module_name!r}: {e}") from e
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ValueError(f"{field}={spec!r}: {module_name} has no {kind} {attr!r}")
    return obj
