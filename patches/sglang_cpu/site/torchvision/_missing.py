"""Placeholders that raise when used: importing a name works, calling it says why it cannot work here."""

import types


class _Missing:
    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._qualname} was called, but torchvision here is the stand-in from patches/sglang_cpu (text-only "
            "CPU SGLang serving). Image processing needs a real torchvision build matching torch."
        )

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._qualname}.{name}")

    def __mro_entries__(self, bases):
        """Used as a base class (``class Processor(torchvision.X)``): a class that raises when instantiated."""
        qualname = self._qualname

        def __init__(self, *args, **kwargs):
            _Missing(qualname)()

        return (type(qualname.rsplit(".", 1)[-1], (), {"__init__": __init__}),)

    def __repr__(self):
        return f"<torchvision stand-in placeholder {self._qualname}>"


def missing(qualname: str) -> _Missing:
    return _Missing(qualname)


class PlaceholderModule(types.ModuleType):
    """A module every attribute of which is a placeholder (and a package, so submodules import too)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")
