"""`Sequential` and `Lambda`: chaining layers and plain functions."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, overload

import jax
import wadler_lindig as wl

from ..module import Module, field


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

    Attributes:
        fn: the function, called with the layer's input (``Lambda(jax.nn.relu)``).
    """

    fn: Callable[..., Any] = field(static=True)

    def __call__(self, x: Any) -> Any:
        """Applies the function.

        Args:
            x: what `fn` takes.

        Returns:
            ``fn(x)``.
        """
        with jax.named_scope("Lambda"):
            return self.fn(x)

    def __pdoc__(self, **kwargs: Any) -> wl.AbstractDoc:
        return wl.TextDoc(f"Lambda({_name(self.fn)})")


@functools.cache
def _takes(layer_type: type, keyword: str) -> bool:
    """Whether `layer_type.__call__` accepts `keyword` (``key``: Dropout, attention;
    ``train``: BatchNorm, Sequential)."""
    try:
        parameters = inspect.signature(layer_type.__call__).parameters
    except (TypeError, ValueError):
        return False
    found = parameters.get(keyword)
    return found is not None and found.kind in (found.KEYWORD_ONLY, found.POSITIONAL_OR_KEYWORD)


def _trained(index: int, layer: Module, out: Any) -> tuple[Any, Module]:
    """The ``(y, new_layer)`` that `layer`, called with ``train=True``, returned."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Module)):
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise TypeError(
            f"Sequential(train=True) calls layers.{index} ({type(layer).__name__}) with "
            f"train=True and expects the pair (y, new_layer) back, as BatchNorm returns; "
            f"got {got}. Return (y, self) from a layer with no state to update, or call the "
            f"Sequential without train= (nn.train_forward collects updates instead)."
        )
    return out


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

    ``seq(x, train=...)`` hands the mode on to every layer whose ``__call__`` takes a
    ``train=`` keyword (:class:`BatchNorm`, a nested ``Sequential``, a module of your
    own). ``train=True`` returns ``(y, new_seq)``: each such layer is called with
    ``train=True``, must return ``(y, new_layer)``, and ``new_seq`` holds the new
    layers (BatchNorm's updated running statistics). ``train=False`` returns ``y``,
    every such layer using its running statistics. Without ``train=`` no layer gets
    one, so that under :func:`train_forward` they train.

    Args:
        *layers: modules, or plain functions of one argument, in the order they are
            called.

    Attributes:
        layers: the layers, functions wrapped in :class:`Lambda`.
    """

    layers: tuple[Module, ...]

    def __init__(self, *layers: Module | Callable[..., Any]):
        self.layers = tuple(x if isinstance(x, Module) else Lambda(x) for x in layers)

    def __call__(self, x: Any, *, key: Any = None, train: bool | None = None) -> Any:
        """Returns ``layers[-1](...layers[1](layers[0](x)))``.

        Args:
            x: the first layer's input.
            key: a PRNG key, split into one key per layer and given to the layers whose
                ``__call__`` takes ``key=``; None gives none a key.
            train: given to the layers whose ``__call__`` takes ``train=``; None gives
                it to none.

        Returns:
            The last layer's output ``y`` (`x` itself with no layers); with
            ``train=True``, the pair ``(y, new_seq)``, ``new_seq`` holding the layers
            as training returned them.

        Raises:
            TypeError: with ``train=True``, a layer given it returns something other
                than a pair ``(y, new_layer)``.
        """
        with jax.named_scope("Sequential"):
            keys = [None] * len(self.layers)
            if key is not None and self.layers:
                keys = list(jax.random.split(key, len(self.layers)))
            layers = list(self.layers)
            for i, (layer, layer_key) in enumerate(zip(self.layers, keys, strict=True)):
                kwargs: dict[str, Any] = {}
                if layer_key is not None and _takes(type(layer), "key"):
                    kwargs["key"] = layer_key
                if train is not None and _takes(type(layer), "train"):
                    kwargs["train"] = train
                x = layer(x, **kwargs)  # pyright: ignore[reportCallIssue]
                if train and "train" in kwargs:
                    x, layers[i] = _trained(i, layer, x)
            return (x, self.replace(layers=tuple(layers))) if train else x

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
