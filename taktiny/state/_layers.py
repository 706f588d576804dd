"""The two forms of a stack's state: stacked (``layers.block.<rest>``, one leaf
``[count, ...]``) and per layer (``layers.<i>.<rest>``, one slice per layer).

A model's per-layer form is one object, `Layers`: which stacked leaf and layer each
per-layer name is, each layer's leaf (abstract), and the model with each stack a list of
those layers (its twin). Both loads of per-layer names resolve them against the twin, by
the one resolution of names, and `_stacker` writes the layers they give into the stacked
leaves (JAX arrays are immutable: the floor is one new array per leaf touched; the
model's other leaves are kept as they are). The problems of the two forms are here too.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any, NamedTuple, cast

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import taktiny.state._problems as err

from .._problems import StateProblem, groups_of
from ..arrays import default_device
from ._names import (
    Custom,
    Spec,
    Stacked,
    customs,
    fields,
    is_stack,
    split_layer,
    stack_of,
)
from ._views import Flat, Walk


def unstacked(spec: Spec, leaves: list[Any], params: bool = False) -> dict[str, Any]:
    """The flat state with every stacked leaf given per layer, its slices in layer order,
    each layer's leaves together (as a list of blocks orders them), where the stack's
    first leaf stands. With `params`, a custom parameter's slices are given as one value
    of its own type under its name (a stacked QArray's layers as QArrays), as a nested
    state gives custom parameters; without, its parts by their names."""
    out: dict[str, Any] = {}
    done: set[str] = set()
    whole = _stacked_params(spec) if params else {}
    for name, leaf in zip(spec.names, leaves, strict=True):
        stack = spec.stack_of(name)
        if stack is None:
            out[name] = leaf
            continue
        if stack.block in done:
            continue
        done.add(stack.block)
        group = [(n, spec.index[n]) for n in spec.names if n.startswith(stack.block + ".")]
        layer: Callable[[Any, int], Any] = lambda leaf, i: (
            layer_sharded(leaf) if isinstance(leaf, jax.ShapeDtypeStruct) else layer_slice(leaf, i)
        )
        for i in range(stack.count):
            for stacked, position in group:
                param = whole.get(position)
                if param is None:
                    out[stack.layer_name(stacked, i)] = layer(leaves[position], i)
                elif position == param[1].start:  # (its first part: the whole value, once)
                    custom = param[1]
                    parts = [layer(leaves[p], i) for p in range(custom.start, custom.stop)]
                    out[stack.layer_name(param[0], i)] = custom.treedef.unflatten(parts)
    return out


def _stacked_params(spec: Spec) -> dict[int, tuple[str, Custom]]:
    """The custom parameters of the stacks' blocks (a stacked QArray), by the position of
    each of their leaves: (the parameter's stacked name, its `Custom` entry)."""
    return {
        position: (name, custom)
        for name, custom in customs(spec.template)
        if spec.stack_of(name) is not None
        for position in range(custom.start, custom.stop)
    }


def layer_slice(leaf: Any, index: int) -> Any:
    """Layer `index` of a stacked array (a copy), placed as the stacked one without its
    layer axis: on a mesh of explicit axes that splits the layer axis, JAX asks where the
    slice goes (``.at[...].get(out_sharding=...)``); anywhere else it follows."""
    sharding = None if isinstance(leaf, Tracer) else getattr(leaf, "sharding", None)
    if (
        isinstance(sharding, NamedSharding)
        and sharding.mesh.are_all_axes_explicit
        and len(sharding.spec)
        and sharding.spec[0] is not None
    ):
        array = cast(Any, leaf)  # (JAX leaves `.at` unannotated)
        return array.at[index].get(out_sharding=layer_sharding(sharding, array.ndim))
    return leaf[index]


def layer_of(value: Any, index: int) -> Any:
    """Layer `index` of a stacked value: each of its leaves' (an array's, or a custom
    parameter's) `layer_slice`."""
    return jax.tree.map(functools.partial(layer_slice, index=index), value)


def layer_sharding(sharding: Any, ndim: int) -> Any:
    """The sharding of one layer of a stacked leaf of `ndim` axes on `sharding`: a
    NamedSharding without its layer axis (replicated along a mesh axis that split the
    layers); any other sharding as it is."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = (*sharding.spec, *(None,) * (ndim - len(sharding.spec)))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]))


def layer_sharded(leaf: Any) -> jax.ShapeDtypeStruct:
    """One layer of a stacked leaf, abstract (a ``jax.ShapeDtypeStruct``): its shape
    without the layer axis, its dtype, on `layer_sharding` of its sharding."""
    sharding = layer_sharding(getattr(leaf, "sharding", None), len(leaf.shape))
    return jax.ShapeDtypeStruct(tuple(leaf.shape[1:]), leaf.dtype, sharding=sharding)


@dataclasses.dataclass(frozen=True)
class Slice:
    """One layer of a concrete stacked leaf, as a load sees it: its shape, dtype and
    sharding (no values: the layer keeps the stacked leaf's unless the load writes it).
    Not a ``jax.ShapeDtypeStruct``, which a load takes for a leaf with no value."""

    shape: tuple[int, ...]
    dtype: Any
    sharding: Any


def layer_leaf(leaf: Any) -> Any:
    """One layer of a stacked leaf, as the per-layer form holds it (`layer_sharded`): a
    ``jax.ShapeDtypeStruct`` for an abstract leaf, a `Slice` for a concrete one."""
    layer = layer_sharded(leaf)
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return layer
    return Slice(layer.shape, layer.dtype, layer.sharding)


class Layers:
    """A model's per-layer form, the one description both loads of per-layer names ask:
    which stacked leaf and layer a per-layer name is (:meth:`slice_of`, by the one parse,
    :meth:`split`), what each layer's leaf is (:meth:`layer`), which stacked leaves
    some names cover in every layer (:meth:`covered`), and the model with each stack a
    list of its layers (:attr:`twin`), which the streamed load resolves a checkpoint
    against.

    Attributes:
        tree: the model (it holds stacks).
        view: the model flattened once.
    """

    def __init__(self, tree: Any, view: Flat) -> None:
        self.tree, self.view = tree, view

    def slice_of(self, name: str) -> tuple[str, int] | None:
        """The stacked leaf the per-layer leaf `name` is a slice of, and the layer; None
        for any other name."""
        hit = self.split(name)
        return None if hit is None or hit[0] not in self.view.spec.index else hit[:2]

    def split(self, name: str) -> tuple[str, int, Stacked] | None:
        """The per-layer name `name` parsed (``Spec.split_layer``): the stacked name it is a
        slice of (a leaf's, or a custom parameter's, whose parts are the leaves), the
        layer, and the stack; None for any other name."""
        return self.view.spec.split_layer(name)

    def stacked_leaf(self, stacked: str) -> Any:
        """The model's stacked leaf of that name."""
        return self.view.olds[self.view.spec.index[stacked]]

    def sharding(self, stacked: str) -> Any:
        """The sharding of a stacked leaf (the default device when it has none)."""
        old = self.stacked_leaf(stacked)
        return getattr(old, "sharding", None) or SingleDeviceSharding(default_device())

    def hosted(self, stacked: str) -> bool:
        """Whether a stacked leaf is filled on the host: it lies on one CPU device."""
        devices = self.sharding(stacked).device_set
        return len(devices) == 1 and next(iter(devices)).platform == "cpu"

    def layer(self, stacked: str) -> Any:
        """One layer of the stacked leaf `stacked` (`layer_leaf`)."""
        return layer_leaf(self.stacked_leaf(stacked))

    def covered(self, names: Iterable[str]) -> set[str]:
        """The stacked leaves whose every layer is among the per-layer `names`."""
        layers: dict[str, set[int]] = {}
        for name in names:
            hit = self.slice_of(name)
            if hit is not None:
                layers.setdefault(hit[0], set()).add(hit[1])
        return {n for n, given in layers.items() if len(given) == self.stacked_leaf(n).shape[0]}

    @functools.cached_property
    def twin(self) -> Any:
        """The model with each stack replaced by the list of its layers, each leaf a
        `layer_leaf`: a walk down the stacks' paths, no flatten (the nodes on them
        rebuilt, the others kept)."""
        stacks = self.view.spec.stacks

        def layers(node: Any, stack: Stacked) -> list[Any]:
            field: str = getattr(node, "_taktiny_stacked")  # noqa: B009  (nn.Stack's class attribute)
            block = jax.tree.map(layer_leaf, getattr(node, field))
            return [block] * stack.count

        if is_stack(self.tree):
            return layers(self.tree, stacks[0])
        walk = Walk(self.tree)
        replaced: dict[tuple[str, ...], Any] = {}
        for stack in stacks:
            where = tuple(stack.path.split("."))
            node = self.tree
            for key in where:
                node = cast("tuple[str, Any]", walk.child(node, key))[1]
            replaced[where] = layers(node, stack)
        return walk.write(replaced)


class Forms(NamedTuple):
    """What :func:`other_forms` finds: one problem per stack or list of layers given in
    the other form, the given names it tells of, the model's leaves it covers (a list
    of layers given as a stack: not each told missing as well), and the stacked leaves
    given whole to a load that resolves per layer, each with the per-layer leaves it fills
    (`whole`: read whole and cut into its layers)."""

    problems: list[StateProblem]
    explained: set[str]
    covered: set[str]
    whole: dict[str, tuple[str, ...]]


def other_forms(
    given: Iterable[tuple[str, Any]],
    leaves: Mapping[str, Any],
    stacks: Iterable[Stacked],
    source: str,
    named: Container[str] = (),
    params: Container[str] = (),
) -> Forms:
    """The names a load does not know (`given`: name and value, or a tensor's header; a
    nested dict of them) that are a stack of layers where the model (its `leaves` by name,
    its `stacks`) holds a list, or more layers per layer than its stack holds: one problem
    for each such stack, instead of one unknown name per leaf. A stack's name is the
    list's with a word in the layer's place (``layers.block.…``: nn.Stack's field), its
    value one axis more than the list's leaf (when both have shapes). A stacked leaf of
    `stacks` given whole where the load resolves per layer (the model's per-layer twin)
    and some of its layers are `named` too is one problem (`both_forms`; its other layers
    not told missing besides), as a load of values tells it; with none of them named, it
    fills them all (`Forms.whole`), as it fills the stacked leaf in a load of values; so
    does a stacked custom parameter whose per-layer names are among `params` (a load of
    values cuts it; the streamed load does not yet). `source` is ``"checkpoint"`` or
    ``"state"``, as the message names it."""
    flat: dict[str, Any] = {}
    origin: dict[str, str] = {}  # each flat name -> the name given (a nested group's)
    for name, value in given:
        if isinstance(value, Mapping):  # (a nested state's group; too deep: not a stack's)
            if not _string_keys(cast("Mapping[Any, Any]", value)):
                continue
            inside: dict[str, Any] = {}
            _dotted(cast("Mapping[str, Any]", value), name, inside)
            flat.update(inside)
            origin.update(dict.fromkeys(inside, name))
        else:
            flat[name] = value
            origin[name] = name
    if not flat:  # (every name known: a load's common case costs nothing here)
        return Forms([], set(), set(), {})
    names = list(leaves)
    known = set(names) | groups_of(names)
    stacks = tuple(stacks)
    by_path = {stack.path: stack for stack in stacks}
    lists: dict[tuple[str, str], list[str]] = {}  # (path, stacked field) -> names given
    beyond: dict[str, dict[int, list[str]]] = {}  # stack's path -> layer -> names given
    both: dict[str, list[str]] = {}  # a stacked leaf given whole -> its layers given too
    whole: dict[str, tuple[str, ...]] = {}  # a stacked leaf given whole -> its layers
    covered = set[str]()  # (its layers not given: not told missing besides)
    for name in flat:
        stack = stack_of(name, stacks)
        each = [] if stack is None else [stack.layer_name(name, i) for i in range(stack.count)]
        if any(n in named for n in each):
            both[name] = [n for n in each if n in named]
            covered.update(each)
            continue
        if each and (each[0] in leaves or each[0] in params):  # (none of its layers
            # given: it fills them all; in a streamed load, a float array for a stack of
            # quantized parameters is not cut: told unknown)
            whole[name] = tuple(each)
            covered.update(each)
            continue
        parts = name.split(".")
        for j in range(len(parts) - 1):
            head, key, rest = ".".join(parts[:j]), parts[j], ".".join(parts[j + 1 :])
            first = f"{head}.0.{rest}" if head else f"0.{rest}"  # (its name in layer 0)
            stack = by_path.get(head)
            if stack is not None and key.isdigit() and str(int(key)) == key:
                if int(key) >= stack.count and {first, f"{stack.block}.{rest}"} & known:
                    beyond.setdefault(head, {}).setdefault(int(key), []).append(name)
                    break
            elif j and stack is None and not key.isdigit() and first in known:
                if _one_axis_more(flat[name], leaves.get(first)):
                    lists.setdefault((head, key), []).append(name)
                break
    problems = [both_forms(name, layers) for name, layers in both.items()]
    explained = {origin[n] for n in [*both, *whole]}
    for (path, field), found in lists.items():
        count = next(i for i in itertools.count() if f"{path}.{i}" not in known)
        shapes = (getattr(flat[n], "shape", None) for n in found)
        layers = next((int(shape[0]) for shape in shapes if shape), None)
        problems.append(stacked_into_list(path, f"{path}.{field}", layers, count, source))
        explained.update(origin[n] for n in found)
        covered.update(n for n in names if _in_layer(n, path))
    for path, found in beyond.items():
        stack = by_path[path]
        layers = max(found) + 1
        problems.append(beyond_stack(path, stack.block, layers, stack.count, source))
        explained.update(origin[n] for group in found.values() for n in group)
    return Forms(problems, explained, covered, whole)


def _one_axis_more(value: Any, leaf: Any) -> bool:
    """Whether `value` (a stacked leaf, or a tensor's header) has one axis more than the
    layer's `leaf`, the layer axis; True when either has no shape to tell."""
    shape, own = getattr(value, "shape", None), getattr(leaf, "shape", None)
    return shape is None or own is None or len(shape) == len(own) + 1


def _in_layer(name: str, path: str) -> bool:
    """Whether `name` is the leaf of a layer of the list at `path` (``layers.3.…``)."""
    head, _, tail = name[len(path) + 1 :].partition(".") if path else name.partition(".")
    return (not path or name.startswith(path + ".")) and head.isdigit() and bool(tail)


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Nested dicts of dotted names: ``{"a.b": x}`` -> ``{"a": {"b": x}}``."""
    out: dict[str, Any] = {}
    for name, value in flat.items():
        *groups, last = name.split(".")
        node = out
        for key in groups:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def _string_keys(node: Mapping[Any, Any], depth: int = 0) -> bool:
    """Whether every key of the nested `node` is a string and it nests no deeper than a
    tree does (other keys, and a state that contains itself, are the load's to tell)."""
    if depth > _DEEPEST:
        return False
    return all(
        type(k) is str
        and (not isinstance(v, Mapping) or _string_keys(cast("Mapping[Any, Any]", v), depth + 1))
        for k, v in node.items()
    )


def _dotted(node: Mapping[str, Any], prefix: str, out: dict[str, Any]) -> None:
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            _dotted(value, name, out)  # pyright: ignore[reportUnknownArgumentType]
        else:
            out[name] = value


_DEEPEST = 100  # a nested state deeper than this is left to the load (it may contain itself)
_UNKNOWN = object()  # a node the walk cannot look into (a PyTree node of another kind)


def _child(node: Any, key: Any) -> Any:
    """The child of a tree's node under one part of a name: None where there is none,
    `_UNKNOWN` for a node of a kind the walk does not know."""
    found = fields(node)
    if found is not None:
        return found.get(key)
    if isinstance(node, tuple) and hasattr(cast("tuple[Any, ...]", node), "_fields"):
        return getattr(cast("tuple[Any, ...]", node), str(key), None)  # (optax's states)
    if isinstance(node, (list, tuple)):
        items = cast("list[Any] | tuple[Any, ...]", node)
        return items[int(key)] if str(key).isdigit() and int(key) < len(items) else None
    if isinstance(node, Mapping):
        return cast("Mapping[Any, Any]", node).get(key)
    if isinstance(node, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return None
    return _UNKNOWN


def _names_stack(node: Any, state: Mapping[Any, Any]) -> bool:
    """Whether the nested `state` names a stack of `node` by a layer's index."""
    if is_stack(node):
        return any(type(k) is str and k.isdigit() for k in state)
    for key, value in state.items():
        if type(key) is str and isinstance(value, Mapping):
            child = _child(node, key)
            if child is _UNKNOWN:
                return True
            if child is not None and _names_stack(child, cast("Mapping[Any, Any]", value)):
                return True
    return False


def names_layers(tree: Any, state: Mapping[Any, Any], flat: bool) -> bool:
    """Whether `state` (flat or nested, as `flat` says) may name a leaf of one of the
    tree's stacks per layer: a walk down the names it gives, no flatten (a load of a few
    names that goes through no stack walks the tree; one that does flattens it)."""
    if flat:  # (as the nested state of its names: each node on their paths visited once)
        nested: dict[str, Any] = {}
        for name in state:
            if type(name) is str:
                *groups, last = name.split(".")
                node = nested
                for key in groups:
                    child: Any = node.get(key)
                    if type(child) is not dict:  # (new, or a shorter name's leaf)
                        child = node[key] = {}
                    node = cast("dict[str, Any]", child)
                node.setdefault(last, None)  # (a leaf: not looked into)
        state = nested
    return _names_stack(tree, state)


# --- The problems of stacks of layers ------------------------------------------


def both_forms(name: str, layers: list[str]) -> StateProblem:
    shown = ", ".join(repr(n) for n in layers[:3]) + (", ..." if len(layers) > 3 else "")
    return StateProblem(
        "structure",
        name,
        "the stacked leaf or its layers",
        f"both ({shown})",
        f"given both whole and per layer ({shown}): a load takes a stack's leaf in one form; "
        f"drop one of them.",
    )


def _named_layers(path: str, count: int) -> str:
    """The names of a list of `count` layers at `path`: ``'layers.0' … 'layers.3'``."""
    names = [f"{path}.{i}" if path else str(i) for i in (0, count - 1)]
    return f"{names[0]!r}" if count == 1 else f"{names[0]!r} … {names[1]!r}"


def _whose(source: str) -> tuple[str, str]:
    """The fix for a state of a stacked model where a list of layers belongs: in a
    checkpoint (`source` ``"checkpoint"``), or in memory (``"state"``)."""
    if source == "checkpoint":
        return "this checkpoint", "save_safetensors(path, model.flat_state_dict(unstacked=True))"
    return "this state", "model.state_dict(unstacked=True), or flat_state_dict(unstacked=True)"


def stacked_into_list(
    path: str, stacked: str, layers: int | None, count: int, source: str
) -> StateProblem:
    """A stack of layers given (its names `stacked`.<rest>, each with a leading axis of
    `layers`, None when unknown) where the model holds a list of `count` layers at `path`;
    `source`: ``"checkpoint"`` or ``"state"``."""
    holds, fix = _whose(source)
    axis = "a leading layer axis" if layers is None else f"a leading layer axis of {layers}"
    stack = "a stack of layers" if layers is None else f"a stack of {layers} layers"
    hint = (
        f"{holds} holds {stack} at {path!r} (names '{stacked}.…' with {axis}); the model "
        f"holds a list of {count} layers, {_named_layers(path, count)}. Give the stacked model's "
        f"state per layer, named as a list names its layers ({fix}), or hold the model's "
        f"layers in an nn.Stack."
    )
    if layers is not None and layers != count:
        hint += f" The counts differ too: {layers} layers against {count}."
    expected = f"a list of {count} layers ({_named_layers(path, count)})"
    return StateProblem("structure", path, expected, f"{stack} ('{stacked}.…')", hint)


def beyond_stack(path: str, block: str, layers: int, count: int, source: str) -> StateProblem:
    """Per-layer names of `layers` layers at `path`, where the model's stack there holds
    `count` < `layers` (its block's leaves `block`.<rest>)."""
    holds = _whose(source)[0]
    extra = "layer" if layers == count + 1 else "layers"
    left = str(count) if layers == count + 1 else f"{count} … {layers - 1}"
    hint = (
        f"{holds} holds {layers} layers at {path!r}, per layer ({_named_layers(path, layers)}); "
        f"the model holds a stack of {count} layers there (names '{block}.…' with a leading "
        f"layer axis of {count}). Per-layer names load into a stack, as many layers as it "
        f"holds: make the model's nn.Stack of {layers} layers, or leave out {extra} {left}."
    )
    expected = f"a stack of {count} layers ('{block}.…')"
    return StateProblem("structure", path, expected, f"{layers} layers, per layer", hint)


def layer_without_value(name: str, stacked: str, given: list[int]) -> StateProblem:
    shown = ", ".join(map(str, given[:8])) + (", ..." if len(given) > 8 else "")
    layers = (
        f"layers {shown} of {stacked!r} are"
        if len(given) > 1
        else f"layer {shown} of {stacked!r} is"
    )
    return StateProblem(
        "abstract",
        name,
        "a value",
        None,
        f"not supplied, while {layers}: the model is abstract, so this layer has no value "
        f"to keep; give every layer, or load into a concrete model.",
    )


def missing_layer(name: str, stacked: str, given: list[int], abstract: bool) -> StateProblem:
    """The problem of the layer `name` of the stacked leaf `stacked` that a load leaves
    unfilled while it fills the layers `given`: an `abstract` leaf's layer has no value to
    keep (`layer_without_value`); else it is missing (under ``strict=True``). Both loads
    tell it so, through `unfilled_layers`."""
    return layer_without_value(name, stacked, given) if abstract else err.missing(name)


def unfilled_layers(
    absent: Iterable[tuple[str, bool]], named: Container[str], stacks: Iterable[Stacked]
) -> dict[str, StateProblem]:
    """The problems of the abstract per-layer leaves of `stacks` (a model's per-layer
    twin's, by name, each with whether it is abstract: `absent`) that a load leaves
    unfilled while it fills (`named`) other layers of the same stacked leaf: as the load
    of values tells them (`missing_layer`)."""
    stacks = tuple(stacks)
    given: dict[str, list[int]] = {}  # each stacked leaf's layers filled (worked out once)
    out: dict[str, StateProblem] = {}
    for name, abstract in absent:
        hit = split_layer(name, stacks) if abstract else None
        if hit is None:
            continue
        stacked, _, stack = hit
        if stacked not in given:
            layers = range(stack.count)
            given[stacked] = [i for i in layers if stack.layer_name(stacked, i) in named]
        if given[stacked]:
            out[name] = missing_layer(name, stacked, given[stacked], abstract)
    return out
