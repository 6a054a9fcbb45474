"""``torchvision.transforms`` stand-in: ``InterpolationMode`` is real (SGLang's configs and transformers use its
members as values at import time); every other name is a placeholder that raises when called, and submodules
(``functional``, ``v2``, ...) import as placeholder modules (see ``torchvision/__init__.py``)."""

from enum import Enum

from torchvision._missing import missing


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return missing(f"torchvision.transforms.{name}")
