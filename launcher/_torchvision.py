"""Let torchvision import beside a torch its C++ extension cannot load into.

PyPI's torchvision wheels are CUDA builds. Beside a CPU build of the same torch (the fast install
on machines without a GPU) their extension fails to load, and torchvision means to go on without
it: its pure-Python parts (the layers timm uses, the transforms torchmetrics and transformers
import) work. But ``torchvision/_meta_registrations.py`` registers fake kernels for ``nms`` and
``qnms`` without checking that the extension loaded, so the import raises ``operator
torchvision::nms does not exist``, and with it ``import lightning`` (torchmetrics imports
torchvision whenever it is installed), ``import timm`` and much of transformers. No setting turns
that registration off.

:func:`install` (run by ``import launcher``) puts a finder first on ``sys.meta_path``, through
which the first import of torchvision runs with one fallback: if it fails and torchvision's own
``extension._has_ops()`` says its extension did not load, the two operators are declared here,
without kernels, and the import runs again. Calling ``torchvision.ops.nms`` then raises
torchvision's own "Couldn't load custom C++ ops". Where the extension loads (a CUDA torch with its
matching torchvision) the import is torchvision's alone: declaring the operators before the
extension loads would abort the process there, so nothing is declared ahead of a failure.

This module imports nothing heavy itself: ``launcher.schedule`` stays free of torch.
"""

from __future__ import annotations

import importlib.abc
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

#: the operators torchvision registers fake kernels for whether or not its extension loaded
UNGUARDED = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def _declare_unguarded() -> None:
    import torch

    for name, schema in UNGUARDED.items():
        if not hasattr(torch.ops.torchvision, name):
            torch.library.define(f"torchvision::{name}", schema)


class _Loader(importlib.abc.Loader):
    """torchvision's own loader, run again once the operators are declared if its extension failed."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        assert module.__spec__ is not None  # the import system sets it before a loader runs
        module.__spec__.loader = module.__loader__ = self.loader  # the module is torchvision's as usual
        try:
            self.loader.exec_module(module)
            return
        except RuntimeError:
            extension = sys.modules.get("torchvision.extension")
            if extension is None or extension._has_ops():
                raise  # not the missing extension: a real error
        _declare_unguarded()
        # the failed run left the submodules it finished behind: run the whole package afresh
        for name in [m for m in sys.modules if m.startswith("torchvision.")]:
            del sys.modules[name]
        self.loader.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Gives torchvision's spec, as the finders after it find it, :class:`_Loader` as its loader.
    It stays on ``sys.meta_path``: a look-up (``importlib.util.find_spec``, as transformers and
    torchmetrics make) is no import, and once torchvision is imported no import asks the finders."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if name != "torchvision":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Route the process's first ``import torchvision`` through the fallback (once; a no-op if
    torchvision is already imported)."""
    if "torchvision" not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
