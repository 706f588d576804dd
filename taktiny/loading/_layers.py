"""Loading per-layer names into a stack of layers (``nn.Stack``), slice by slice.

A checkpoint written per layer (``model.layers.{i}...`` converted to ``layers.{i}...``)
loads into a model whose stacks hold each parameter once, ``[count, ...]``. The load then
runs on the model's per-layer twin: each stack replaced by a list of ``count`` abstract
blocks, each leaf a ``jax.ShapeDtypeStruct`` of one layer's shape on the stacked leaf's
sharding without the layer axis. Every step, check and plan is the load's own, over
per-layer names. Each slice the load places is written at once into its stacked leaf,
made (zeros) on the leaf's sharding at the first slice and updated in place by a jitted
``dynamic_update_slice`` that donates it: no stacked array is ever assembled beside its
parts, and the host holds no more than the load does for an unstacked model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..state import Flat, Stacked, flatten, key_name, layer_sharding, load_resolved


@dataclasses.dataclass(frozen=True)
class Slice:
    """One layer of a concrete stacked leaf, as the load sees it: its shape, dtype and
    sharding (no values: the layer keeps the stacked leaf's unless the load writes it).
    Not a ``jax.ShapeDtypeStruct``, which a load takes for a leaf with no value."""

    shape: tuple[int, ...]
    dtype: Any
    sharding: Any


def _layer_leaf(leaf: Any) -> Any:
    """One layer of a stacked leaf, on the leaf's sharding without the layer axis
    (replicated along a mesh axis that split the layers): a ``jax.ShapeDtypeStruct`` for
    an abstract leaf, a `Slice` for a concrete one."""
    sharding = layer_sharding(getattr(leaf, "sharding", None), len(leaf.shape))
    shape = tuple(leaf.shape[1:])
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=sharding)
    return Slice(shape, leaf.dtype, sharding)


def _twin(tree: Any, stacks: Sequence[Stacked]) -> Any:
    """`tree` with each stack replaced by the list of its layers, abstract."""
    paths = {s.path: s for s in stacks}
    is_stack = lambda x: hasattr(type(x), "_taktiny_stacked")

    def layers(path: Any, node: Any) -> Any:
        if not is_stack(node):
            return node
        stack = paths[".".join(map(key_name, path))]
        block = jax.tree.map(_layer_leaf, getattr(node, type(node)._taktiny_stacked))
        return [block] * stack.count

    if is_stack(tree):
        return layers((), tree)
    return jax.tree_util.tree_map_with_path(layers, tree, is_leaf=is_stack)


@dataclasses.dataclass(frozen=True)
class Layered:
    """A load of per-layer names into a model's stacks: the model itself (flattened once),
    and each per-layer leaf name's stacked leaf and layer.

    Attributes:
        view: the model itself, flattened once (its leaves, their names).
        twin: the model with each stack as a list of abstract layers: what the load walks.
        slices: each per-layer leaf name -> (its stacked leaf's name, the layer).
    """

    view: Flat
    twin: Any
    slices: Mapping[str, tuple[str, int]]


def layered(model: Any) -> Layered:
    """The per-layer twin of `model` (which holds stacks) for a load."""
    spec = flatten(model)[2]
    twin = _twin(model, spec.stacks)
    slices: dict[str, tuple[str, int]] = {}
    for name in spec.names:
        stack = spec.stack_of(name)
        if stack is not None:
            for i in range(stack.count):
                slices[stack.layer_name(name, i)] = (name, i)
    return Layered(Flat(model), twin, slices)


class Stacker:
    """The stacked leaves a load fills slice by slice: ``stacker.update(placed)`` takes
    the load's placed per-layer values (others pass through into `placed`), writing each
    into its stacked leaf in place. `covered` says which stacked leaves the load fills in
    every layer (made as zeros); the others start as a copy of the model's leaf."""

    def __init__(self, layers: Layered, covered: set[str]) -> None:
        self.layers = layers
        self.olds = dict(zip(layers.view.spec.names, layers.view.olds, strict=True))
        self.covered = covered
        self.placed: dict[str, Any] = {}  # the twin's other leaves, by name
        self.stacked: dict[str, jax.Array] = {}  # the stacked leaves begun

    def update(self, values: Iterable[tuple[str, Any]]) -> None:
        """Takes the placed ``(name, value)`` pairs (``dict.update``'s pairs)."""
        for name, value in values:
            hit = self.layers.slices.get(name)
            if hit is None:
                self.placed[name] = value
            else:
                self.write(hit[0], hit[1], value)

    def write(self, stacked: str, index: int, value: jax.Array) -> None:
        """Writes one layer's value into its stacked leaf (begun at its first slice)."""
        big = self.stacked.get(stacked)
        if big is None:
            old = self.olds[stacked]
            sharding = getattr(old, "sharding", None) or value.sharding
            if stacked in self.covered:
                big = _zeros(tuple(old.shape), jnp.dtype(old.dtype), sharding)()
            else:  # some layers: the others keep their values (a copy: ours to donate)
                big = _copy(sharding)(old)
        self.stacked[stacked] = _writer(big.sharding)(big, value, index)

    def model(self) -> Any:
        """The model with the leaves the load placed (its stacked leaves whole)."""
        view = self.layers.view
        index = view.spec.index
        supplied = [(index[n], v) for n, v in (*self.placed.items(), *self.stacked.items())]
        return load_resolved(view, supplied)


def covered(layers: Layered, targets: Iterable[str]) -> set[str]:
    """The stacked leaves whose every layer is among the per-layer `targets`."""
    counts: dict[str, int] = {}
    for name in targets:
        hit = layers.slices.get(name)
        if hit is not None:
            counts[hit[0]] = counts.get(hit[0], 0) + 1
    olds = dict(zip(layers.view.spec.names, layers.view.olds, strict=True))
    return {name for name, n in counts.items() if n == olds[name].shape[0]}


# The jitted functions a load calls, one per shape and sharding for the whole process: a
# fresh function per load would be traced and compiled again by every load
@functools.cache
def _zeros(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Any:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.cache
def _copy(sharding: Any) -> Any:
    return jax.jit(jnp.copy, out_shardings=sharding)


@functools.cache
def _writer(sharding: Any) -> Any:
    write = lambda big, part, i: jax.lax.dynamic_update_index_in_dim(big, part, i, 0)
    return jax.jit(write, donate_argnums=0, out_shardings=sharding)
