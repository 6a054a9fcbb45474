"""Loading what a user names in the config: a built-in by name, or ``module:attribute``.

The module is one Python can import (an installed package, or on ``sys.path``), else a file: ``path/to/file.py`` (its
folder is put on ``sys.path``, so that its own imports of modules beside it work), or ``module`` (``a.b``: ``a/b.py``)
found in the working directory. A config file turns a ``module:attribute`` whose module lies beside it into the file's
path (``config.load_config``), so the spec means the same from any working directory and in any process (a reward
worker, a rank under torchrun) that loads it.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path


def module_file(module_name: str, folder: str | Path) -> Path | None:
    """The file of ``module_name`` (dotted) in ``folder``: ``a/b.py`` or the package ``a/b/__init__.py``; None."""
    base = Path(folder, *module_name.split("."))
    for candidate in (base.with_name(base.name + ".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _import_file(path: Path, module_name: str | None = None, root: Path | None = None):
    """Import the .py file ``path`` as its stem, its folder put on ``sys.path``; or as ``module_name`` from ``root``
    (``root``/a/b.py as ``a.b``)."""
    if module_name is None and path.name == "__init__.py":  # a package's folder
        module_name, root = path.parent.name, path.parent.parent
    root = Path(root if root is not None else path.parent).resolve()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(module_name or path.stem)


def load_named(spec: str, builtin: dict, field: str, form: str, kind: str):
    """``builtin[spec]``, or ``attribute`` of ``module`` for ``spec = "module:attribute"`` (callable); ``module`` may be
    a ``.py`` file's path. Errors are ValueErrors naming ``field`` (e.g. "data.reward"), the expected ``form``
    ("module:function") / ``kind``, and where a module that is not found was looked for."""
    if spec in builtin:
        return builtin[spec]
    if ":" not in spec:
        raise ValueError(f"{field}={spec!r} is neither a built-in ({sorted(builtin)}) nor '{form}'")
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(os.path.expanduser(module_name))
            if not path.is_file():
                raise ValueError(f"{field}={spec!r}: {path} does not exist")
            module = _import_file(path)
        else:
            module = _import_module(module_name, spec, field)
    except ImportError as e:
        raise ValueError(f"{field}={spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ValueError(f"{field}={spec!r}: {module_name} has no {kind} {attr!r}")
    return obj


def _import_module(module_name: str, spec: str, field: str):
    """``module_name`` from the Python path, else from the working directory; a ValueError saying where it looked."""
    top = module_name.split(".")[0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name not in (top, module_name):  # the module was found; something it imports is missing
            raise
    found = module_file(module_name, os.getcwd())
    if found is not None:
        return _import_file(found, module_name, os.getcwd())
    raise ValueError(f"{field}={spec!r}: cannot import module {module_name!r}: no {top}.py (or package {top}/) beside "
                     f"the config file (for a spec given in it), in the working directory {os.getcwd()} or on the "
                     f"Python path (sys.path); put the file beside the config, or give its path: "
                     f"{field}=path/to/{top}.py:{spec.rpartition(':')[2]}")
