"""`train_forward`: run a model in training mode and get it back with the state its layers
updated (BatchNorm's running statistics), however deep those layers sit."""

from __future__ import annotations

import contextvars
from typing import Any

import jax
from jax.core import Tracer

from ..module import Module

# While train_forward runs: id(layer) -> (layer, its successor), filled by the layers it
# calls. Read at trace time only, inside one call: nothing leaks between jit traces.
_UPDATES: contextvars.ContextVar[dict[int, tuple[Any, Any]] | None] = contextvars.ContextVar(
    "taktiny_training_updates", default=None
)


def training() -> bool:
    """Whether a layer is being called under :func:`train_forward`."""
    return _UPDATES.get() is not None


def latest(layer: Any) -> Any:
    """`layer` as the updates so far leave it: a layer called twice in one forward pass
    updates its statistics twice, as PyTorch's does."""
    updates = _UPDATES.get()
    found = None if updates is None else updates.get(id(layer))
    return layer if found is None else found[1]


def record(layer: Any, successor: Any) -> None:
    """Called by a layer in training mode: `successor` replaces `layer` in the model that
    :func:`train_forward` returns."""
    updates = _UPDATES.get()
    if updates is None:
        raise RuntimeError("record() is only called by layers running under train_forward().")
    updates[id(layer)] = (layer, successor)


def train_forward(model: Module, *args: Any, **kwargs: Any) -> tuple[Any, Module]:
    """Calls ``model(*args, **kwargs)`` in training mode and returns ``(output, model)``
    where the returned model holds the state its layers updated.

    Every :class:`BatchNorm` inside `model`, however deep, normalises with the batch's
    statistics and moves its running statistics towards them; no ``train=`` flag and no
    updated layers are threaded through the parents' ``__call__``. The new statistics
    come back only in the returned model, so they cannot be dropped without saying so::

        def loss_fn(model, x, y):
            logits, model = nn.train_forward(model, x)
            return loss(logits, y), model

        (value, model), grads = jax.value_and_grad(loss_fn, has_aux=True)(model, x, y)

    Works inside ``jax.jit`` and ``jax.grad``. The layers must be called directly within
    the model's ``__call__``: inside a ``jax.lax.scan``, ``jax.checkpoint``, ``jax.vmap``
    or ``jax.jit`` of their own, such a transformation calls a traced copy of the layer,
    whose update cannot reach the model, and ``train_forward`` raises a ValueError saying
    so rather than dropping it. Call a layer there with ``train=True`` instead, which
    returns ``(y, new_layer)``, and carry the new layer out yourself.

    Args:
        model: the module to run.
        *args: its positional arguments.
        **kwargs: its keyword arguments (``key=`` for dropout, say).

    Returns:
        ``(output, updated_model)``.

    Raises:
        ValueError: a layer ran in training mode on a copy that is not part of `model`
            (inside a transformation of its own, or made during the call), so its new
            state has nowhere to go.
    """
    updates: dict[int, tuple[Any, Any]] = {}
    token = _UPDATES.set(updates)
    try:
        out = model(*args, **kwargs)  # pyright: ignore[reportCallIssue]
    finally:
        _UPDATES.reset(token)
    if not updates:
        return out, model
    replaced: set[int] = set()

    def swap(node: Any) -> Any:
        if id(node) in updates:
            replaced.add(id(node))
            return updates[id(node)][1]
        return node

    new = jax.tree_util.tree_map(swap, model, is_leaf=lambda node: id(node) in updates)
    if missing := [layer for key, (layer, _) in updates.items() if key not in replaced]:
        kinds = ", ".join(sorted({type(layer).__name__ for layer in missing}))
        name = type(model).__name__
        # (its fields read raw: flattening would read a leaked tracer, which JAX refuses)
        traced = any(isinstance(v, Tracer) for layer in missing for v in vars(layer).values())
        if traced:  # copies a transformation inside the call made (or layers made there)
            raise ValueError(
                f"train_forward: {len(missing)} layer(s) ({kinds}) ran in training mode on "
                f"traced copies that are not part of the {name} given, so their new "
                f"statistics have nowhere to go. This happens to a layer called inside a "
                f"transformation of its own within {name}.__call__ (jax.lax.scan, "
                f"jax.checkpoint, jax.vmap, jax.jit), which calls a copy of it: call such a "
                f"layer with train=True, which returns (y, new_layer), and carry the new layer "
                f"out of the transformation yourself (in a scan's carry, say). A layer made "
                f"during the call instead of stored in a field of the model does it too."
            )
        raise ValueError(
            f"train_forward: {len(missing)} layer(s) ({kinds}) ran in training mode but are "
            f"not part of the {name} given, so their new statistics have nowhere to go. Store "
            f"every layer the model calls in one of its fields."
        )
    return out, new
