"""Public names imported when first used (PEP 562), for the packages' ``__init__`` files,
and modules imported when first used, for the header path: the ``taktiny`` command, and a
process that only opens safetensors headers, never import JAX, and NumPy only to read a
tensor."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any


def exports(
    package: str, names: Mapping[str, tuple[str, str | None]], found: MutableMapping[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of `package`, whose public `names` map to (the
    module defining each, relative to the package; its name there, or None for the module
    itself). A name, once imported, goes into `found` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = names[name]
        value = importlib.import_module(module, package)
        if attribute is not None:
            value = getattr(value, attribute)
        found[name] = value  # (found directly from now on)
        return value

    def __dir__() -> list[str]:
        return sorted({*found, *names})

    return __getattr__, __dir__


def module(name: str) -> Any:
    """The module `name` if it is imported already, else a stand-in that imports it when
    one of its attributes is first read: for modules, such as NumPy, that a command may not
    need at all (NumPy's import alone takes longer than ``taktiny inspect`` may).

    The stand-in lives only in the globals of the module that asked for it: unlike
    ``importlib.util.LazyLoader``, it puts nothing into ``sys.modules``, where a module
    loaded lazily breaks whatever imports it, or its submodules, later (SciPy's import,
    and so every transformers model class, fails on a lazily loaded NumPy)."""
    return sys.modules.get(name) or _Deferred(name)


class _Deferred:
    """Stands in for the module it names: reading an attribute imports the module (an
    ordinary import) and keeps the attribute's value on the stand-in, where the next read
    finds it as fast as on the module itself."""

    def __init__(self, name: str) -> None:
        self.__module = name

    def __getattr__(self, attribute: str) -> Any:
        value = getattr(importlib.import_module(self.__module), attribute)
        setattr(self, attribute, value)
        return value

    def __repr__(self) -> str:
        return f"<module {self.__module!r}, imported when first used>"
