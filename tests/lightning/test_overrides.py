"""Every Lightning hook that a class of ``launcher/lightning/`` overrides is marked ``@override``
(``typing_extensions``, as Lightning marks its own), so a hook Lightning renames or drops is found
by a type checker, not by a run that silently stops calling it."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import launcher.lightning


def _overriding() -> list[tuple[str, object]]:
    out = []
    for info in pkgutil.iter_modules(launcher.lightning.__path__):
        mod = importlib.import_module(f"launcher.lightning.{info.name}")
        for cls in vars(mod).values():
            if not (inspect.isclass(cls) and cls.__module__ == mod.__name__
                    and any(b.__module__.startswith("lightning") for b in cls.__mro__[1:])):
                continue
            for name, obj in vars(cls).items():
                if name.startswith("__") or not any(name in vars(b) for b in cls.__mro__[1:]):
                    continue
                fn = obj.fget if isinstance(obj, property) else getattr(obj, "__wrapped__", obj)
                if inspect.isfunction(fn):
                    out.append((f"{cls.__name__}.{name}", fn))
    return out


def test_every_overridden_lightning_hook_is_marked():
    found = _overriding()
    assert len(found) > 30  # the strategy's hooks and the callbacks' are all seen
    assert [name for name, fn in found if not getattr(fn, "__override__", False)] == []
