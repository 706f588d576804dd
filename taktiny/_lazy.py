"""Names imported when first used (PEP 562), for the packages' faces (their ``__init__``),
and modules imported when first used, for the header path: the ``taktiny`` command, and a
process that only opens safetensors headers, never import JAX, and NumPy only to read a
tensor."""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable, MutableMapping
from typing import Any


def face(
    package: str, init: str, found: MutableMapping[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The ``__getattr__``, ``__dir__`` and ``__all__`` of `package`, whose ``__init__``
    file is `init`: every name is written once, in the stub beside it (``__init__.pyi``,
    which type checkers read), as ``from .module import name as name``; a name is imported
    when first used, and then kept in `found` (the package's globals).

    The stub's names after its first string statement below its docstring (their
    heading) are those only Taktiny's own packages use: importable, but not public, so
    left out of ``__all__`` and ``dir()``."""
    names: dict[str, tuple[str, str | None]] = {}  # name -> (its module, its name there)
    public: list[str] = []
    with open(init[: -len(".py")] + ".pyi", encoding="utf-8") as stub:
        body = ast.parse(stub.read()).body
    inside = True
    docstring = bool(body) and ast.get_docstring(ast.Module(body[:1], [])) is not None
    for statement in body[docstring:]:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            inside = False  # (the heading of the names for Taktiny's own packages)
        elif isinstance(statement, ast.ImportFrom):
            dots = "." * statement.level
            for alias in statement.names:
                name = alias.asname or alias.name
                if statement.module is None:  # (`from . import module as module`)
                    names[name] = (dots + alias.name, None)
                else:
                    names[name] = (dots + statement.module, alias.name)
                if inside and not name.startswith("_"):
                    public.append(name)

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
        hidden = names.keys() - set(public)
        return sorted({*found, *public} - hidden)

    return __getattr__, __dir__, sorted(public)


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
