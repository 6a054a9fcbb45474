"""Stand-in for ``torchvision`` inside a CPU SGLang 0.5.23 server.

SGLang imports torchvision at start-up through its multimodal configs (``sglang.srt.configs.deepseek_ocr``), and
transformers, seeing a ``torchvision`` on the path, imports ``torchvision.io`` / ``transforms.v2`` from its image
utilities, even for text-only models. PyPI's torchvision wheels do not load beside CPU torch 2.13 ("operator
torchvision::nms does not exist"). So every ``torchvision.*`` module imports here, each name in it is a placeholder
that raises when *called*, and the one name used at import time as a value (``transforms.InterpolationMode``) is
a real enum. Image models are out of scope for a CPU rollout server.
"""

import importlib.abc
import importlib.machinery
import sys

from _gspo_sglang_cpu_check import require_supported_sglang

require_supported_sglang("torchvision")

from torchvision._missing import PlaceholderModule, missing  # noqa: E402

__version__ = "0.0.0+gspo.stand.in"


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any ``torchvision.x.y`` without a file here imports as a ``PlaceholderModule``."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        for finder in sys.meta_path:  # a real file in this stand-in (e.g. transforms/) wins
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return PlaceholderModule(spec.name)

    def exec_module(self, module):
        pass


if not any(isinstance(f, _PlaceholderFinder) for f in sys.meta_path):
    sys.meta_path.append(_PlaceholderFinder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return missing(f"torchvision.{name}")
