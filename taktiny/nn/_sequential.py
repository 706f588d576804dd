"""`Sequential` and `Lambda`: chaining layers and plain functions."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, overload

import jax
import wadler_lindig as wl

from .._module import Module, field


def _name(fn: Any) -> str:
    """A short readable name for a function: ``relu``, ``partial(gelu, approximate=False)``."""
    if isinstance(fn, functools.partial):
        args = [_name(fn.func), *map(repr, fn.args)]
        args += [f"{k}={v!r}" for k, v in fn.keywords.items()]
        return f"partial({', '.join(args)})"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if isinstance(name, str) else repr(fn)


class Lambda(Module):
    """Wraps a plain function (``jax.nn.relu``, say) as a module with no parameters.

    The function is static: it is part of the tree structure, never a leaf. Its repr
    is the function's name: ``Lambda(relu)``.
    """

    fn: Callable[..., Any] = field(static=True)

    def __call__(self, x: Any) -> Any:
        """Returns ``fn(x)``."""
        with jax.named_scope("Lambda"):
            return self.fn(x)

    def __pdoc__(self, **kwargs: Any) -> wl.AbstractDoc:
        return wl.TextDoc(f"Lambda({_name(self.fn)})")


@functools.cache
def _takes_key(layer_type: type) -> bool:
    """Whether `layer_type.__call__` accepts a ``key=`` keyword (Dropout, attention)."""
    try:
        parameters = inspect.signature(layer_type.__call__).parameters
    except (TypeError, ValueError):
        return False
    key = parameters.get("key")
    return key is not None and key.kind in (key.KEYWORD_ONLY, key.POSITIONAL_OR_KEYWORD)


class Sequential(Module):
    """Calls its layers in order, each on the previous one's output.

    Plain functions among the layers are wrapped in :class:`Lambda`. The layers are
    stored in ``layers``, so their state names are ``layers.0...``, ``layers.1...``
    (a function takes a position but has no parameters). Indexing gives a layer, a
    slice a shorter ``Sequential``.

    ``seq(x, key=key)`` hands randomness on: the key is split into one key per layer
    and every layer whose ``__call__`` takes a ``key=`` keyword (:class:`Dropout`,
    :class:`MultiHeadAttention`, a module of your own) gets its own; without a key,
    no layer gets one (evaluation).
    """

    layers: tuple[Module, ...]

    def __init__(self, *layers: Module | Callable[..., Any]):
        self.layers = tuple(x if isinstance(x, Module) else Lambda(x) for x in layers)

    def __call__(self, x: Any, *, key: Any = None) -> Any:
        """Returns ``layers[-1](...layers[1](layers[0](x)))``, with ``key`` split among
        the layers that take one."""
        with jax.named_scope("Sequential"):
            keys = [None] * len(self.layers)
            if key is not None and self.layers:
                keys = list(jax.random.split(key, len(self.layers)))
            for layer, layer_key in zip(self.layers, keys, strict=True):
                if layer_key is not None and _takes_key(type(layer)):
                    x = layer(x, key=layer_key)  # pyright: ignore[reportCallIssue]
                else:
                    x = layer(x)  # pyright: ignore[reportCallIssue]
            return x

    @overload
    def __getitem__(self, index: int) -> Module: ...

    @overload
    def __getitem__(self, index: slice) -> Sequential: ...

    def __getitem__(self, index: int | slice) -> Module | Sequential:
        if isinstance(index, slice):
            return Sequential(*self.layers[index])
        return self.layers[index]

    def __iter__(self) -> Iterator[Module]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)
