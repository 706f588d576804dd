"""Which leaves of a tree are trained: the ``trainable`` marker of fields, read as a tree."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..arrays import CACHE_BOUND
from ..quant import Parameter
from ._module import Module

_TRAINABLE: dict[Any, list[bool]] = {}  # tree structure -> trainable flag per leaf


def _flags(node: Any, trainable: bool, out: list[bool], adapter: bool, marks: list[bool]) -> None:
    """Appends, in flatten order, whether each leaf under `node` is trained to `out`, and
    whether it is an adapter's (a field its class lists in ``_taktiny_adapters``) to
    `marks`. A hole (None where a leaf was, as in a gradient tree from
    ``eqx.filter_grad``) has no leaf, so it appends nothing."""
    if isinstance(node, Module):
        declared = type(node)._taktiny_fields
        adapters = getattr(type(node), "_taktiny_adapters", ())
        for name, is_data in type(node)._taktiny_layout:
            if is_data:
                keep = trainable and getattr(declared.get(name), "trainable", True)
                _flags(node.__dict__[name], keep, out, adapter or name in adapters, marks)
        return
    if isinstance(node, Parameter):  # a QArray: neither its integers nor its scales trained
        for part in node.part_values():
            _flags(part, trainable and node.trained, out, adapter, marks)
        return
    children, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # a leaf
        out.append(trainable)
        marks.append(adapter)
        return
    for child in children:
        _flags(child, trainable, out, adapter, marks)


def trainable(tree: Any) -> Any:
    """Which leaves of `tree` are trained: a tree of the same structure with ``True`` for
    parameters and ``False`` for the arrays of fields declared with
    ``nn.field(trainable=False)`` (BatchNorm's running statistics, say) and for both parts
    of every :class:`~taktiny.QArray`: its integer ``value`` cannot take a gradient step,
    and its ``scale`` only describes how the integers were rounded, so a quantized weight
    is frozen whole (train an adapter on it, :func:`taktiny.lora`). Any other leaf that is
    not a float (an integer step counter, a PRNG key array) is ``False`` too, so that the
    leaves marked ``True`` are exactly those a gradient can be taken of.

    A tree holding low-rank adapters (:func:`taktiny.lora`) trains its adapters only:
    every leaf outside them (the base weights of the adapted layers, and the norms,
    embeddings and layers left without one) is marked ``False``, as PEFT freezes the
    whole base model. :func:`taktiny.merge_lora` gives the plain model, all trained
    again.

    Pass the function itself where optax takes a mask or labels, so that optax calls it
    with the parameters (a module is callable, and optax would call a module-shaped
    mask)::

        optax.adamw(1e-3, mask=tt.trainable)       # no weight decay on statistics
        optax.multi_transform({True: optax.adam(1e-3), False: optax.set_to_zero()},
                              tt.trainable)

    `tree` may have holes: None where a leaf was, as in the gradients that
    ``eqx.filter_grad`` returns (None for every integer leaf) or a tree filtered by
    ``eqx.filter``; the result has the same holes. So optax may call it on the updates
    as well as on the parameters.

    Args:
        tree: a module, or any PyTree holding modules.

    Returns:
        `tree`'s structure with a bool at each leaf.
    """
    treedef = jax.tree_util.tree_structure(tree)
    flags = _TRAINABLE.get(treedef)
    if flags is None:
        flags, marks = [], []
        _flags(tree, True, flags, False, marks)
        if any(marks):  # fine-tuned through adapters: nothing else is trained
            flags = [f and m for f, m in zip(flags, marks, strict=True)]
        if len(_TRAINABLE) >= CACHE_BOUND:
            _TRAINABLE.clear()
        _TRAINABLE[treedef] = flags
    leaves = treedef.flatten_up_to(tree)
    return treedef.unflatten([f and _inexact(x) for f, x in zip(flags, leaves, strict=True)])


_INEXACT: dict[Any, bool] = {}  # dtype -> whether a gradient step can change it


def _inexact(leaf: Any) -> bool:
    """Whether `leaf` may be trained by its kind: a float or complex array (or a leaf
    without a dtype, such as a Python float); an integer, bool or key array cannot be."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return True
    known = _INEXACT.get(dtype)
    if known is None:
        known = _INEXACT[dtype] = bool(jnp.issubdtype(dtype, jnp.inexact))
    return known
