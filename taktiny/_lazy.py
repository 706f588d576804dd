"""Public names imported when first used (PEP 562), for the packages' ``__init__`` files:
the ``taktiny`` command, and a process that only opens safetensors headers, never import
JAX."""

from __future__ import annotations

import importlib
import importlib.util
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
    """The module `name`, imported now if it is already, else loaded when one of its
    attributes is first read (``importlib.util.LazyLoader``): for modules, such as NumPy,
    that a command may not need at all."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return importlib.import_module(name)  # (raises ModuleNotFoundError, naming it)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    lazy = importlib.util.module_from_spec(spec)
    sys.modules[name] = lazy
    loader.exec_module(lazy)
    return lazy
