"""Two views of a tree for loading: the same questions (the child of a node by name, the
leaves of a custom parameter, writing new leaves), declared once as `View` and answered
two ways.

`Flat` flattens the tree once and answers from the cached template of its names: a load
that names every leaf (or many) costs one flatten and one unflatten. `Walk` starts at the
root and visits only the nodes on the paths to the leaves named, then rebuilds only those
nodes: a load that names a few leaves costs what it touches, not the size of the tree.
A leaf's `where` is its position in `Flat` and its key path in `Walk`. A load chooses its
view before it resolves a single name, and resolves once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import taktiny.state._names as _names

from ..arrays import ARRAY_TYPES, SCALARS
from ..quant import Parameter
from ._names import Custom, Entry, tree_util
from ._values import array_type

LEAF, GROUP, PARAM = "leaf", "group", "param"
Where = TypeVar("Where")  # how a view names a leaf: its position, or its key path
WhereIn = TypeVar("WhereIn", contravariant=True)  # (the same, as Leaves only takes it)


@runtime_checkable  # (beartype checks the annotations of View.olds in the tests)
class Leaves(Protocol[WhereIn]):
    """The leaves a view has seen, by where they are."""

    def __getitem__(self, where: WhereIn, /) -> Any: ...


@runtime_checkable  # (beartype checks annotations in the tests)
class View(Protocol[Where]):
    """What resolving names and checking values ask of a tree (see the module's note)."""

    root: Any  # the node names start from: a template node, or the tree itself
    sees_all: bool  # whether `olds` holds every leaf, not only those on the paths named

    @property
    def olds(self) -> Leaves[Where]:
        """The tree's leaves seen so far (all of them, for `Flat`); read only."""
        ...

    def child(self, node: Any, key: str) -> tuple[str, Any] | None:
        """What `node` holds under `key`: (LEAF, GROUP or PARAM, the child), or None."""
        ...

    def keys(self, node: Any) -> list[str]:
        """The keys of a group, for messages."""
        ...

    def leaf(self, node: Any, where: tuple[str, ...]) -> Where:
        """Where the leaf `node`, at the key path `where`, is."""
        ...

    def inner(self, node: Any, where: tuple[str, ...]) -> tuple[Any, list[tuple[str, Where]]]:
        """A custom parameter's structure, and its leaves: (name below it, where)."""
        ...

    def param(self, node: Any, where: tuple[str, ...]) -> Any:
        """The custom parameter's value in the tree."""
        ...

    def quantized(self, where: Where) -> tuple[str, Parameter] | None:
        """The name and value of the quantized parameter whose part the leaf at `where`
        is, if any."""
        ...

    def flattened(self) -> tuple[list[Any], _names.Spec]:
        """Every leaf, and the description of the tree."""
        ...

    def name(self, where: Where) -> str:
        """The flat name of the leaf at `where`."""
        ...

    def names(self) -> tuple[str, ...]:
        """The flat name of every leaf."""
        ...

    def new(self) -> Any:
        """A container for new leaves by where (a list, or a dict), to fill and `write`."""
        ...

    def write(self, new: Any) -> Any:
        """The tree with the leaves in `new` written in."""
        ...


# (typed as plain classes: a child found one stays Any, not a half-known ndarray[Unknown])
_LEAF_TYPES: tuple[type[Any], ...] = (*ARRAY_TYPES, *SCALARS)


class Flat:
    """The tree flattened once; leaves found through the template, written by unflatten."""

    sees_all = True

    def __init__(self, tree: Any):
        self.olds, self.treedef, self.spec = _names.flatten(tree)
        self.root: Any = self.spec.template

    def child(self, node: dict[str, Entry], key: str) -> tuple[str, Any] | None:
        child = node.get(key)
        if child is None:
            return None
        return (LEAF if type(child) is int else GROUP if type(child) is dict else PARAM), child

    def keys(self, node: dict[str, Entry]) -> list[str]:
        return list(node)

    def leaf(self, node: int, where: tuple[str, ...]) -> int:
        return node

    def inner(self, node: Custom, where: tuple[str, ...]) -> tuple[Any, list[tuple[str, Any]]]:
        """A custom parameter's structure, and its leaves: (name below it, where)."""
        cut = len(".".join(where)) + 1
        names = self.spec.names[node.start : node.stop]
        return node.treedef, [(n[cut:], i) for i, n in enumerate(names, node.start)]

    def param(self, node: Custom, where: tuple[str, ...]) -> Any:
        """The custom parameter's value in the tree."""
        return node.treedef.unflatten(self.olds[node.start : node.stop])

    def flattened(self) -> tuple[list[Any], _names.Spec]:
        """Every leaf, and the description of the tree."""
        return self.olds, self.spec

    def name(self, where: int) -> str:
        return self.spec.names[where]

    def quantized(self, where: int) -> tuple[str, Parameter] | None:
        """The name and value of the parameter whose part the leaf at `where` is, if any."""
        param, _, part = self.spec.names[where].rpartition(".")
        node: Entry | None = self.spec.template
        for key in param.split("."):
            node = node.get(key) if type(node) is dict else None
        if isinstance(node, Custom):
            value = node.treedef.unflatten(self.olds[node.start : node.stop])
            if isinstance(value, Parameter) and part in value.parts:
                return param, value
        return None

    def names(self) -> tuple[str, ...]:
        return self.spec.names

    def new(self) -> list[Any]:
        return list(self.olds)

    def write(self, new: list[Any]) -> Any:
        return self.treedef.unflatten(new)


class Walk:
    """The tree walked from its root along the paths named; only those nodes rebuilt."""

    sees_all = False

    def __init__(self, tree: Any, flat: bool = False):
        self.root = tree
        self._flat = flat  # flat names share their prefixes: each step is kept
        self.olds: dict[tuple[str, ...], Any] = {}
        self._seen: dict[int, tuple[str, Any]] = {}  # node -> (its kind, its children)
        self._steps: dict[tuple[int, str], Any] = {}  # (node, key) -> what `child` found
        self._params: dict[tuple[str, ...], tuple[tuple[str, ...], Any]] = {}  # leaf -> param
        self._array = array_type()

    def _children(self, node: object) -> tuple[str, Any]:
        """How a node holds its children: "seq" (a list or tuple, by position), "dict" (a
        dict of string keys), "module" (a module's data fields by name) or "other" (any
        other PyTree node: children by key name, and its one-level structure)."""
        found = self._seen.get(id(node))
        if found is None:
            kind = type(node)
            if kind is list or kind is tuple:
                found = "seq", node
            elif kind is dict and all(type(key) is str for key in cast("dict[Any, Any]", node)):
                found = "dict", node
            elif (fields := _names.fields(node)) is not None:
                found = "module", fields
            else:
                pairs, treedef = tree_util.tree_flatten_with_path(
                    node, is_leaf=lambda x: x is not node
                )
                keys = [_names.key_name(path[0]) for path, _ in pairs]
                found = "other", (dict(zip(keys, [c for _, c in pairs], strict=True)), treedef)
            self._seen[id(node)] = found
        return found

    def child(self, node: Any, key: str) -> tuple[str, Any] | None:
        if not self._flat:  # (a nested state names each step once)
            return self._child(node, key)
        step = self._steps.get((id(node), key), self)
        if step is self:
            step = self._steps[(id(node), key)] = self._child(node, key)
        return step

    def _child(self, node: Any, key: str) -> tuple[str, Any] | None:
        kind, children = self._seen.get(id(node)) or self._children(node)
        child: Any
        if kind == "seq":
            index = int(key) if key.isdigit() and str(int(key)) == key else len(children)
            child = children[index] if index < len(children) else None
        else:
            child = (children[0] if kind == "other" else children).get(key)
        if child is None:
            return None
        if type(child) is self._array:
            return LEAF, child
        if not _names.is_param(child):
            return GROUP, child
        if isinstance(child, _LEAF_TYPES):
            return LEAF, child
        treedef = tree_util.tree_structure(child)
        if treedef.num_leaves == 0:
            return None
        return (LEAF if treedef.num_nodes == 1 else PARAM), child

    def keys(self, node: Any) -> list[str]:
        kind, children = self._children(node)
        if kind == "seq":
            return [str(i) for i in range(len(children))]
        return list(children[0] if kind == "other" else children)

    def leaf(self, node: Any, where: tuple[str, ...]) -> tuple[str, ...]:
        self.olds[where] = node
        return where

    def inner(self, node: Any, where: tuple[str, ...]) -> tuple[Any, list[tuple[str, Any]]]:
        paths, treedef = tree_util.tree_flatten_with_path(node)
        found: list[tuple[str, Any]] = []
        for path, leaf in paths:
            inside = tuple(_names.key_name(k) for k in path)
            self.olds[where + inside] = leaf
            self._params[where + inside] = where, node
            found.append((".".join(inside), where + inside))
        return treedef, found

    def param(self, node: Any, where: tuple[str, ...]) -> Any:
        return node

    def flattened(self) -> tuple[list[Any], _names.Spec]:
        leaves, _, spec = _names.flatten(self.root)
        return leaves, spec

    def name(self, where: tuple[str, ...]) -> str:
        return ".".join(where)

    def quantized(self, where: tuple[str, ...]) -> tuple[str, Parameter] | None:
        """The name and value of the parameter whose part the leaf at `where` is, if any."""
        param, node = self._params.get(where, ((), None))
        inside = isinstance(node, Parameter) and len(where) == len(param) + 1
        if inside and where[-1] in node.parts:
            return ".".join(param), node
        return None

    def names(self) -> tuple[str, ...]:
        return _names.flatten(self.root)[2].names

    def new(self) -> dict[tuple[str, ...], Any]:
        return {}

    def write(self, new: dict[tuple[str, ...], Any]) -> Any:
        trie: dict[str, Any] = {}
        for where, value in new.items():
            node = trie
            for key in where[:-1]:
                node = node.setdefault(key, {})
            node[where[-1]] = [value]
        return self._rebuild(self.root, trie)

    def _rebuild(self, node: Any, trie: dict[str, Any]) -> Any:
        """`node` with the values in `trie` written into it: key -> sub-trie (a dict), or
        a new leaf (a one-item list)."""
        if node is not self.root and id(node) not in self._seen:  # a custom parameter
            paths, treedef = tree_util.tree_flatten_with_path(node)
            inner = dict(_flat_trie(trie, ()))
            named = [(tuple(_names.key_name(k) for k in path), leaf) for path, leaf in paths]
            return treedef.unflatten([inner.get(name, leaf) for name, leaf in named])
        kind, children = self._children(node)
        if kind == "seq":
            items = list(children)
            for key, sub in trie.items():
                i = int(key)
                items[i] = sub[0] if type(sub) is list else self._rebuild(items[i], sub)
            return items if type(node) is list else tuple(items)
        named = children[0] if kind == "other" else children
        changed: dict[str, Any] = {
            key: sub[0] if type(sub) is list else self._rebuild(named[key], sub)
            for key, sub in trie.items()
        }
        if kind == "dict":
            return {**node, **changed}
        if kind == "module":
            return _names.rebuild(node, changed)
        values, treedef = children
        return treedef.unflatten([changed.get(k, v) for k, v in values.items()])


def _flat_trie(trie: dict[str, Any], prefix: tuple[str, ...]) -> Iterator[tuple[Any, Any]]:
    for key, sub in trie.items():
        if type(sub) is list:
            yield (*prefix, key), sub[0]
        else:
            yield from _flat_trie(sub, (*prefix, key))
