"""The model package's errors. Each names the config field, tensor or layout setting at fault."""

from __future__ import annotations


class UnsupportedModel(ValueError):
    """A Hugging Face config asks for an architecture or feature the Megatron policy does not map."""


class LayoutError(ValueError):
    """A parallel layout does not fit the model (checked before any process group starts)."""


class MappingError(ValueError):
    """Tensors do not match the architecture's mapping: missing, unexpected, or of the wrong shape."""


class ModelNotFound(FileNotFoundError):
    """A model given as a Hugging Face repo id is neither in huggingface_hub's cache nor downloadable (``hub``)."""


def listing(title: str, names, limit: int = 8) -> str:
    """'title: a, b, c (and 5 more)' for error messages naming many tensors."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return f"{title} ({len(names)}): {shown}{more}"


def exit_status(tool: str, convert) -> int:
    """Run ``convert()`` for a command-line tool: 0, or 2 with one line on stderr for a bad model, layout, tensor
    or path (UnsupportedModel, LayoutError and MappingError are ValueErrors), instead of a traceback."""
    import sys

    from gspo_megatron.parallel import groups

    try:
        convert()
        status = 0
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        print(f"{tool}: error: {e}", file=sys.stderr)
        status = 2
    groups.destroy()  # before the interpreter's exit, which may abort a rank holding gloo groups (groups.destroy)
    return status
