"""Declared module fields: `field()`, collecting annotations, and the generated ``__init__``."""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from typing import Any

MISSING: Any = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class Field:
    """What `field()` records for one declared field."""

    default: Any
    default_factory: Any
    static: bool | None
    trainable: bool = True


def field(
    *,
    default: Any = MISSING,
    default_factory: Any = MISSING,
    static: bool | None = None,
    trainable: bool = True,
) -> Any:
    """Declares a module field with options, as in ``scale: float = field(default=1.0)``.

    Args:
        default: the value used when the generated ``__init__`` is not given one.
        default_factory: a zero-argument callable that makes the default.
        static: ``True`` forces the field into the tree structure (it must hold no
            array); ``False`` forces it to be a PyTree child even when it holds no
            array (Python numbers in it become JAX arrays); ``None`` (the default) sorts
            it by its value.
        trainable: ``False`` marks the arrays under this field as state that is not
            trained (BatchNorm's running statistics, a step counter): they stay in the
            state dicts, but :func:`taktiny.trainable` marks them ``False`` so that
            optimisers leave them alone, and no gradient flows into them (while the
            module holds traced values, the field reads through
            ``jax.lax.stop_gradient``).

    Returns:
        The field's declaration, which the module's class reads when it is defined.

    Raises:
        TypeError: both `default` and `default_factory` are given, or ``static=True``
            with ``trainable=False``.
    """
    if default is not MISSING and default_factory is not MISSING:
        raise TypeError("field() takes `default` or `default_factory`, not both.")
    if static is True and not trainable:
        raise TypeError(
            "field(static=True, trainable=False) contradicts itself: a static field holds no "
            "arrays, so there is nothing to train or to keep from training. Drop one of them."
        )
    return Field(default, default_factory, static, trainable)


# A string annotation such as "ClassVar[int]" or "typing.ClassVar": an optional module
# prefix and a name, as `dataclasses` reads them.
_STRING_ANNOTATION = re.compile(r"^\s*(?:(\w+)\s*\.)?\s*(\w+)")


def _is_classvar(cls: type, annotation: Any) -> bool:
    """Whether `annotation` is ``ClassVar`` or ``ClassVar[...]``, also when written as a
    string (``from __future__ import annotations``): the name is looked up in the module
    that defines `cls`, so a type that merely has ``ClassVar`` in its name is a field."""
    if isinstance(annotation, str):
        match = _STRING_ANNOTATION.match(annotation)
        if match is None:
            return False
        prefix, name = match.groups()
        scope = vars(sys.modules.get(cls.__module__, typing))
        if prefix is not None:
            scope = vars(scope[prefix]) if inspect.ismodule(scope.get(prefix)) else {}
        annotation = scope.get(name)
    return annotation is typing.ClassVar or typing.get_origin(annotation) is typing.ClassVar


def declared_fields(cls: type, namespace: dict[str, Any]) -> dict[str, Field]:
    """The annotated fields of `cls` and its bases, base classes' first; removes `field()`
    placeholders from the class body."""
    fields: dict[str, Field] = {}
    for klass in reversed(cls.__mro__[1:]):
        fields.update(getattr(klass, "_taktiny_fields", {}))
    for name, annotation in namespace.get("__annotations__", {}).items():
        if name.startswith("__") or _is_classvar(cls, annotation):
            continue
        value = namespace.get(name, MISSING)
        if isinstance(value, Field):
            fields[name] = value
            delattr(cls, name)
        else:
            fields[name] = Field(value, MISSING, None)
    return fields


class _Factory:
    """Stands for a default that a factory makes, in a generated ``__init__``'s signature."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()


def generated_init(cls: type, fields: dict[str, Field]) -> Any:
    """An ``__init__`` taking the declared fields in order, as a dataclass's does, then
    calling ``__post_init__`` if the class has one."""
    if "self" in fields:
        raise TypeError(
            f"{cls.__name__} declares a field named 'self', the name its generated __init__ "
            f"gives the instance; rename the field."
        )
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for name, spec in fields.items():
        default = inspect.Parameter.empty
        if spec.default_factory is not MISSING:
            default = _FACTORY  # shown as dataclasses show it, not as the factory itself
        elif spec.default is not MISSING:
            default = spec.default
        params.append(
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        )
    try:
        signature = inspect.Signature(params)
    except ValueError as error:
        raise TypeError(f"{cls.__name__}: {error}; give the later fields defaults too.") from None

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        arguments = signature.bind(self, *args, **kwargs).arguments
        for name, spec in fields.items():
            if name in arguments:
                setattr(self, name, arguments[name])
            elif spec.default_factory is not MISSING:
                setattr(self, name, spec.default_factory())
            else:
                setattr(self, name, spec.default)
        if hasattr(self, "__post_init__"):
            self.__post_init__()  # pyright: ignore[reportAttributeAccessIssue]

    __init__.__signature__ = signature  # type: ignore[attr-defined]
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__._taktiny_generated = True  # type: ignore[attr-defined]
    return __init__
