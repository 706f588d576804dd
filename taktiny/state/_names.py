"""Names for the leaves of a PyTree, as the state dicts give them.

One ``tree_flatten_with_path`` describes a tree: the flat name of every leaf, and a
nested template (key -> leaf position, sub-template, or a custom parameter's span).
The description is cached by tree structure, so reading a state is one ``tree_flatten``
and a lookup.

The walk knows a module by its class alone: a class that lists its data fields in a
``_taktiny_data`` attribute (names, in the order JAX flattens them), is registered with
JAX as a dataclass node, and is rebuilt by calling it with all its attributes as keywords
(as JAX's dataclass nodes are). Everything but such nodes, lists, tuples, dicts and None
counts as one parameter and is not walked into.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeGuard, cast

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from ..arrays import CACHE_BOUND


class _TreeUtil(Protocol):
    """What the state walk calls of ``jax.tree_util``, typed. JAX's own signatures name the
    PyTreeDef of jaxlib's compiled module, which has no type stubs, so pyright knows them
    only in part; a structure here is `Any`, a key path a tuple of keys."""

    def tree_flatten(self, tree: Any, /) -> tuple[list[Any], Any]: ...

    def tree_flatten_with_path(
        self, tree: Any, /, is_leaf: Callable[[Any], bool] | None = None
    ) -> tuple[list[tuple[tuple[Any, ...], Any]], Any]: ...

    def tree_structure(self, tree: Any, /) -> Any: ...

    def treedef_is_leaf(self, treedef: Any, /) -> bool: ...

    def keystr(self, keys: tuple[Any, ...], /) -> str: ...


# The module itself (pyright checks it against the Protocol): calls through it are JAX's.
tree_util: _TreeUtil = jax.tree_util


def fields(node: object) -> dict[str, Any] | None:
    """A module's data fields by name, in flatten order; None for anything else."""
    names = getattr(type(node), "_taktiny_data", None)
    if names is None:
        return None
    values = node.__dict__
    return {name: values[name] for name in names}


def rebuild(node: Any, changes: dict[str, Any]) -> Any:
    """A copy of the module `node` with some data fields replaced (rebuilt in C)."""
    return type(node)(**{**node.__dict__, **changes})


def is_param(x: object) -> bool:
    """Whether the walk takes `x` as one parameter: anything but None, modules and the
    lists, tuples and dicts that hold them."""
    return (
        x is not None
        and not isinstance(x, (list, tuple, dict))
        and not hasattr(type(x), "_taktiny_data")
    )


def is_flat(tree: object) -> TypeGuard[Mapping[Any, Any]]:
    """Whether `tree` is a flat ``{name: array}`` mapping (as `save_safetensors` saves
    under its own keys): a mapping whose values are each one leaf."""
    if not isinstance(tree, Mapping):
        return False
    values: list[Any] = list(cast(Mapping[Any, Any], tree).values())
    return all(
        v is not None and tree_util.treedef_is_leaf(tree_util.tree_structure(v)) for v in values
    )


@dataclasses.dataclass(frozen=True)
class Custom:
    """A custom PyTree parameter (a quantized weight): whole in the nested form, its leaves
    at positions ``start:stop`` in the flat one."""

    treedef: Any
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A stack of layers (``nn.Stack``, known by its class's ``_taktiny_stacked``: the
    name of the data field holding its block): at `path`, ``count`` layers held as one
    block whose leaves have a leading layer axis. Its leaves are named ``<block>.<rest>``
    stacked and ``<path>.<i>.<rest>`` per layer."""

    path: str  # the stack's own name ("" at the root)
    block: str  # its block's name ("layers.block"): the prefix of its stacked leaves
    count: int
    axis: str | None  # the mesh axis splitting the layer axis (None: unsplit)

    def layer_name(self, stacked: str, index: int) -> str:
        """The per-layer name of layer `index` of the stacked leaf `stacked`."""
        rest = stacked[len(self.block) + 1 :]
        return f"{self.path}.{index}.{rest}" if self.path else f"{index}.{rest}"


# A template's value: a leaf's position, a sub-template, or a custom parameter.
Entry = int | dict[str, Any] | Custom


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """What the state walk knows about one tree structure."""

    names: tuple[str, ...]  # the flat name of each leaf, in flatten order
    index: dict[str, int]  # name -> leaf position
    template: dict[str, Entry]  # nested: key -> leaf position | sub-template | Custom
    plan: Any  # how to gather a full nested state's values in leaf order (None: can't)
    modules: dict[str, type]  # the class of each module by its path ("": the root)
    stacks: tuple[Stacked, ...] = ()  # the stacks of layers in the tree, outer first

    def stack_of(self, name: str) -> Stacked | None:
        """The stack whose block holds the leaf `name`, or None."""
        return stack_of(name, self.stacks)

    def split_layer(self, name: str) -> tuple[str, int, Stacked] | None:
        """For a per-layer name (``layers.3.attention.query.kernel`` of a stack at
        ``layers``): the stacked leaf it is a slice of, the layer, and the stack; None for
        any other name (a stacked leaf's name among them)."""
        return split_layer(name, self.stacks)


def stack_of(name: str, stacks: Iterable[Stacked]) -> Stacked | None:
    """The one of `stacks` whose block holds the leaf `name` (see `Spec.stack_of`)."""
    for stack in stacks:
        if name.startswith(stack.block + "."):
            return stack
    return None


def split_layer(name: str, stacks: Iterable[Stacked]) -> tuple[str, int, Stacked] | None:
    """The per-layer name `name` of one of `stacks` parsed (see `Spec.split_layer`)."""
    for stack in stacks:
        head = stack.path + "." if stack.path else ""
        if not name.startswith(head):
            continue
        index, dot, rest = name[len(head) :].partition(".")
        if dot and index.isdigit() and str(int(index)) == index and int(index) < stack.count:
            return f"{stack.block}.{rest}", int(index), stack
    return None


_SPECS: dict[Any, Spec] = {}  # tree structure -> its description


def key_name(key: Any) -> str:
    """The name of one step of a key path: an attribute, a position or a dict key."""
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, (DictKey, FlattenedIndexKey)):
        return str(key.key)
    return str(key)


def _names(path: tuple[Any, ...], where: str) -> list[str]:
    names = [key_name(k) for k in path]
    for key, name in zip(path, names, strict=True):
        if "." in name:
            raise TypeError(
                f"{where} has the key {getattr(key, 'key', name)!r} at "
                f"{tree_util.keystr(path)}, which cannot be part of a name: names join "
                f"keys with '.', so a key must hold no '.'. Rename it."
            )
    return names


def _make_spec(tree: Any) -> Spec:
    template: dict[str, Entry] = {}
    names: list[str] = []
    where = type(tree).__name__
    # the root is always walked into
    below_root: Callable[[Any], bool] = lambda x: x is not tree and is_param(x)
    for path, value in tree_util.tree_flatten_with_path(tree, is_leaf=below_root)[0]:
        keys = _names(path, where)
        if not keys:
            raise TypeError(
                f"a {where} is a single array, so it has no names: state dicts name the "
                f"leaves of a module or of a container (a dict, list or tuple) of arrays."
            )
        node: dict[str, Any] = template
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        inner, treedef = tree_util.tree_flatten_with_path(value)
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # an array
            node[keys[-1]] = len(names)
            names.append(".".join(keys))
        elif inner:
            node[keys[-1]] = Custom(treedef, len(names), len(names) + len(inner))
            names += [".".join(keys + _names(sub, where)) for sub, _ in inner]
    index = {name: i for i, name in enumerate(names)}
    if len(index) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise TypeError(f"{where} gives two leaves the same name: {twice[:5]}.")
    modules = _modules(tree, where)
    return Spec(tuple(names), index, template, _plan(template), modules, _stacks(tree, where))


def _is_module(x: object) -> bool:
    """A module (a dataclass node of Taktiny's), or any node whose class declares a state
    version (see :func:`taktiny.migrate`)."""
    return hasattr(type(x), "_taktiny_data") or hasattr(type(x), "state_version")


def _modules(tree: Any, where: str) -> dict[str, type]:
    """The class of every module of `tree` by its path, its keys joined with "." as the
    names of its leaves are ("" for the root, when it is one), outer modules first."""
    found: dict[str, type] = {}

    def walk(node: Any, prefix: list[str]) -> None:
        if _is_module(node):
            found[".".join(prefix)] = type(node)
        inner: Callable[[Any], bool] = lambda x: x is not node and _is_module(x)
        for path, value in tree_util.tree_flatten_with_path(node, is_leaf=inner)[0]:
            if value is not node and _is_module(value):
                walk(value, [*prefix, *_names(path, where)])

    walk(tree, [])
    return found


def is_stack(node: Any) -> bool:
    """Whether `node` is a stack of layers: its class names its stacked field in
    ``_taktiny_stacked`` (``nn.Stack``)."""
    return hasattr(type(node), "_taktiny_stacked")  # pyright: ignore[reportUnknownArgumentType]


def _stacks(tree: Any, where: str) -> tuple[Stacked, ...]:
    """Every stack of layers in `tree` (a node whose class names its stacked field in
    ``_taktiny_stacked``), outer first. A stack inside another's block is refused: its
    leaves would have two layer axes."""
    found: list[Stacked] = []
    for path, node in tree_util.tree_flatten_with_path(tree, is_leaf=is_stack)[0]:
        if not is_stack(node):
            continue
        name = ".".join(_names(path, where))
        field: str = getattr(node, "_taktiny_stacked")  # noqa: B009  (a class attribute of nn.Stack's)
        inner: list[Any] = jax.tree_util.tree_leaves(getattr(node, field), is_leaf=is_stack)
        if any(map(is_stack, inner)):
            raise TypeError(
                f"{where} holds a stack of layers inside the block of the stack at "
                f"{name or 'its root'!r}: a stack's block cannot hold another stack (its "
                f"arrays would have two layer axes). Stack the inner blocks' parameters "
                f"in the outer block's own layer axis instead."
            )
        block = f"{name}.{field}" if name else field
        found.append(Stacked(name, block, node.count, node.layer_axis))
    return tuple(found)


def customs(template: dict[str, Entry], path: tuple[str, ...] = ()) -> Iterator[tuple[str, Custom]]:
    """The flat name and `Custom` entry of every custom parameter in a names template."""
    for key, child in template.items():
        if isinstance(child, Custom):
            yield ".".join((*path, key)), child
        elif isinstance(child, dict):
            yield from customs(child, (*path, key))


def params(leaves: list[Any], spec: Spec) -> dict[str, Any]:
    """Every custom parameter of a tree flattened (a quantized weight), by flat name,
    rebuilt from its `leaves`."""
    return {n: c.treedef.unflatten(leaves[c.start : c.stop]) for n, c in customs(spec.template)}


def _plan(template: dict[str, Entry]) -> Any:
    """For a template node: its key count and segments, each a run of leaf keys (read with
    one itemgetter) or a sub-node; None when a custom parameter makes it irregular."""
    segments: list[tuple[list[str] | str, Any]] = []  # (a run's keys, None) | (key, sub-plan)
    for key, child in template.items():
        if type(child) is dict:
            sub = _plan(child)
            if sub is None:
                return None
            segments.append((key, sub))
        elif type(child) is int:
            if segments and type(segments[-1][0]) is list:
                segments[-1][0].append(key)
            else:
                segments.append(([key], None))
        else:
            return None
    runs = [
        (operator.itemgetter(*keys), len(keys) > 1) if type(keys) is list else (keys, sub)
        for keys, sub in segments
    ]
    return len(template), runs


def gather(plan: Any, state: Any, out: list[Any]) -> None:
    """Appends a full nested state's values in leaf order; raises (LookupError, TypeError or
    AttributeError) when `state` isn't shaped exactly like the template."""
    size, runs = plan
    if len(state) != size:
        raise LookupError
    for first, second in runs:
        if type(second) is bool:  # a run of leaves
            if second:
                out.extend(first(state))
            else:
                out.append(first(state))
        else:
            gather(second, state[first], out)


def flatten(tree: Any) -> tuple[list[Any], Any, Spec]:
    """The leaves of `tree`, its structure, and the names of its leaves."""
    leaves, treedef = tree_util.tree_flatten(tree)
    spec = _SPECS.get(treedef)
    if spec is None:
        if len(_SPECS) >= CACHE_BOUND:
            _SPECS.clear()
        spec = _SPECS[treedef] = _make_spec(tree)
    return leaves, treedef, spec


def nested(template: dict[str, Entry], leaves: list[Any]) -> dict[str, Any]:
    """The nested state: `template` with `leaves` (and custom parameters) filled in."""
    return {
        key: leaves[child]
        if type(child) is int
        else nested(child, leaves)
        if type(child) is dict
        else (custom := cast(Custom, child)).treedef.unflatten(leaves[custom.start : custom.stop])
        for key, child in template.items()
    }
