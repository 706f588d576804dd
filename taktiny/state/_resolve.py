"""Resolving a state's names to the leaves they name, in either view of the tree (see
`_views`): written once for both, for flat names and for nested dicts. A value in another
representation than the model's there (a float array where it holds a `QArray`, the parts
of a QArray under a float array's name) is set aside for `_represent`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, cast

import taktiny.state._problems as err

from .._problems import StateProblem
from ..quant import PARTS
from ._layers import other_forms
from ._names import Stacked, customs, tree_util
from ._problems import describe
from ._represent import Other
from ._views import GROUP, LEAF, View


class Resolved(NamedTuple):
    """What a state names: the value for each leaf (by its `where` in the view), the
    problems of entries that name no leaf, in the order of the state (a stack of layers
    given where the model holds a list, or the reverse, told once: `_layers.other_forms`),
    the values in another representation than the model's (by the `where` of their first
    leaf), the leaves such a stack stands for (not told missing besides), and the stacked
    leaves given whole to a view of the model's per-layer twin, each with the per-layer
    leaves it fills (``Forms.whole``)."""

    supplied: dict[Any, Any]
    problems: tuple[StateProblem, ...]
    other: dict[Any, Other]
    covered: frozenset[str] = frozenset()
    whole: Mapping[str, tuple[str, ...]] = MappingProxyType({})


class _Unknown(NamedTuple):
    """An entry that names nothing: its problem, which suggests the closest name not
    given, is built once every entry is resolved."""

    name: str
    value: Any


class _Found(NamedTuple):
    """What resolving has found so far: as `Resolved`, with unknown entries not yet told."""

    supplied: dict[Any, Any]
    entries: list[StateProblem | _Unknown]
    other: dict[Any, Other]


def resolve(
    view: View[Any],
    state: Mapping[Any, Any],
    flat: bool,
    match: bool = False,
    source: str = "state",
    stacks: Iterable[Stacked] | None = None,
    cut: bool = False,
) -> Resolved:
    """Finds the leaf each entry of `state` names; lists the entries that name none. With
    `match` (``match_quantization=True``), the parts of a quantized parameter named under
    a float array's name are gathered to be converted (or told); without it they are
    unknown names. `source` names the state in messages (``"state"`` or
    ``"checkpoint"``); `stacks`, the stacks of layers a name may give in another form
    (None: the view's own); `cut`: a stacked custom parameter given whole may fill its
    layers in the view (a load of values into a model's per-layer twin cuts it)."""
    found = _Found({}, [], {})
    if flat:
        for name, value in state.items():
            if type(name) is not str:
                same = _resolve_name(view, str(name), value, _Found({}, [], {}), match)
                found.entries.append(non_string_key(repr(name), name, same, flat=True))
            elif not _resolve_name(view, name, value, found, match):
                found.entries.append(_Unknown(name, value))
    else:
        _resolve_nested(view, view.root, state, (), found, {})
    unknown = [(e.name, e.value) for e in found.entries if type(e) is _Unknown]
    if not unknown:
        problems: Any = found.entries
        return Resolved(found.supplied, tuple(problems), found.other)
    leaves, spec = view.flattened()  # (a stack given for a list, or the reverse: told once)
    stacks = spec.stacks if stacks is None else stacks
    given = {view.name(w) for w in found.supplied}
    by_name = dict(zip(spec.names, leaves, strict=True))
    params = {name for name, _ in customs(spec.template)} if cut else ()
    forms = other_forms(unknown, by_name, stacks, source, given, params)
    unknown = [(name, value) for name, value in unknown if name not in forms.explained]
    told = iter(err.unknown(unknown, spec.names, flat, given))
    problems = list(forms.problems)
    for entry in found.entries:
        if not isinstance(entry, _Unknown):
            problems.append(entry)
        elif entry.name not in forms.explained:
            problems.append(next(told))
    covered = frozenset(forms.covered)
    return Resolved(found.supplied, tuple(problems), found.other, covered, forms.whole)


def _resolve_name(view: View[Any], name: str, value: Any, found: _Found, match: bool) -> bool:
    """Resolves one flat name; False when it names no leaf (a group, the inside of an
    array, or nothing)."""
    node, keys = view.root, tuple(name.split("."))
    for i, key in enumerate(keys):
        step = view.child(node, key)
        if step is None:
            return False
        kind, node = step
        if kind is GROUP:
            continue
        if kind is LEAF:
            if i + 1 < len(keys):
                if match and i + 2 == len(keys) and keys[-1] in PARTS:  # a QArray's part
                    _other_part(view, view.leaf(node, keys[:-1]), keys[-1], value, found)
                    return True
                return False
            found.supplied[view.leaf(node, keys)] = value
            return True
        if i + 1 == len(keys):  # a custom parameter named whole
            if isinstance(value, Mapping):
                return False
            _resolve_param(view, node, keys, value, found)
            return True
        rest = ".".join(keys[i + 1 :])  # inside a custom parameter
        where = next((w for n, w in view.inner(node, keys[: i + 1])[1] if n == rest), None)
        if where is None:
            return False
        found.supplied[where] = value
        return True
    return False


def _resolve_nested(
    view: View[Any],
    node: Any,
    state: Mapping[Any, Any],
    path: tuple[str, ...],
    found: _Found,
    above: dict[int, tuple[str, ...]],
) -> None:
    """Resolves a nested state (a dict of `node`'s children). It follows the tree, so it
    goes no deeper than the tree does; `above` holds the path of each dict on the way to
    `state` by its id (they are alive: each holds the next), to tell a state that contains
    itself."""
    above[id(state)] = path
    for key, value in state.items():
        if type(key) is not str:
            name = ".".join((*path, repr(key)))
            same = view.child(node, str(key)) is not None
            found.entries.append(non_string_key(name, key, same, flat=False))
            continue
        if "." in key:
            found.entries.append(dotted_key(".".join((*path, key))))
            continue
        where = (*path, key)
        step = view.child(node, key)
        if step is None:
            found.entries.append(_Unknown(".".join(where), value))
            continue
        kind, child = step
        if kind is LEAF:
            found.supplied[view.leaf(child, where)] = value
        elif kind is GROUP:
            if type(value) is dict or isinstance(value, Mapping):
                group = cast("Mapping[Any, Any]", value)
                outer = above.get(id(group))
                if outer is None:
                    _resolve_nested(view, child, group, where, found, above)
                else:
                    found.entries.append(contains_itself(".".join(where), ".".join(outer)))
            else:
                name = ".".join(where)
                found.entries.append(group_expected(name, view.keys(child), value))
        else:
            _resolve_param(view, child, where, value, found)
    del above[id(state)]


def _resolve_param(
    view: View[Any], node: Any, where: tuple[str, ...], value: Any, found: _Found
) -> None:
    """A custom parameter given whole: its leaves, when `value` has its structure; else
    (a float array where the model holds a QArray, say) the value set aside. Given as a
    dict (nested states only), its parts by name ({"value": ..., "scale": ...})."""
    treedef, inner = view.inner(node, where)
    if isinstance(value, Mapping):
        name, by_name = ".".join(where), dict(inner)
        for part, given in _parts(cast("Mapping[Any, Any]", value), (), by_name):
            if part in by_name:
                found.supplied[by_name[part]] = given
            else:
                parts = [n for n, _ in inner]
                found.entries.append(unknown_part(f"{name}.{part}", parts))
        return
    try:
        leaves, given = tree_util.tree_flatten(value)
    except (RecursionError, SystemError):  # a list that contains itself, say (SystemError:
        found.entries.append(too_deep(".".join(where), value))  # from C++'s recursion)
        return
    if given != treedef:
        wheres = tuple(w for _, w in inner)
        found.other[wheres[0]] = Other(".".join(where), view.param(node, where), wheres, value)
        return
    for (_, w), leaf in zip(inner, leaves, strict=True):
        found.supplied[w] = leaf


def _other_part(view: View[Any], where: Any, part: str, value: Any, found: _Found) -> None:
    """A part of a QArray named under an array of the model (``kernel.value`` where the
    model holds a float ``kernel``), gathered with the other parts for `_represent`."""
    other = found.other.get(where)
    if other is None:
        old = view.olds[where]
        other = found.other[where] = Other(view.name(where), old, (where,), {}, flat=True)
    other.given[part] = value


def _parts(
    state: Mapping[Any, Any],
    prefix: tuple[str, ...],
    leaves: Mapping[str, Any],
    depth: int | None = None,
) -> Iterator[tuple[str, Any]]:
    """The (dotted name, value) pairs of a dict of a custom parameter's parts; a name of one
    of its `leaves` takes its value as it is (a dict there is reported as one), and so does
    a dict as deep as the deepest leaf (`depth` dots: a name past it is no part's)."""
    if depth is None:
        depth = max((name.count(".") for name in leaves), default=0)
    for key, value in state.items():
        name = ".".join((*prefix, str(key)))
        if isinstance(value, Mapping) and name not in leaves and len(prefix) < depth:
            yield from _parts(cast("Mapping[Any, Any]", value), (*prefix, str(key)), leaves, depth)
        else:
            yield name, value


# --- The problems these checks find -----------------------------------------------


def unknown_part(name: str, parts: Sequence[str]) -> StateProblem:
    return StateProblem(
        "unknown",
        name,
        list(parts),
        name,
        f"unknown key; this parameter's parts are {list(parts)}.",
    )


def dotted_key(name: str) -> StateProblem:
    return StateProblem(
        "key",
        name,
        "a key without '.'",
        name.rsplit(".", 1)[-1],
        "nested state keys must not contain '.'; nest it as a dict, or pass dotted names to "
        "load_flat_state_dict().",
    )


def non_string_key(name: str, key: Any, as_string_exists: bool, flat: bool) -> StateProblem:
    same = f"; did you mean {str(key)!r}?" if as_string_exists else "."
    return StateProblem(
        "key",
        name,
        "a str key",
        key,
        f"{'flat' if flat else 'nested'} state keys must be strings, got "
        f"{type(key).__name__} {key!r}{same}",
    )


def contains_itself(name: str, outer: str) -> StateProblem:
    """A nested state that contains itself: the dict at `name` is the one at `outer`."""
    got = f"the dict at {outer!r}" if outer else "the whole state"
    return StateProblem(
        "structure",
        name,
        "a dict of this submodule's parameters",
        got,
        f"its value is {got}, which contains it: a state that contains itself never ends. "
        f"Give this name a dict of its own parameters.",
    )


def too_deep(name: str, value: Any) -> StateProblem:
    """A value that nests too deeply to be read (a list that contains itself, say)."""
    return StateProblem(
        "structure",
        name,
        "a value of this parameter's structure",
        describe(value),
        f"got {describe(value)} nested too deeply to be read (it may contain itself); give "
        f"this parameter as the model holds it, or a dict of its parts.",
    )


def group_expected(name: str, keys: list[str], value: Any) -> StateProblem:
    return StateProblem(
        "structure",
        name,
        f"a dict with keys {keys[:6]}",
        describe(value),
        f"expected a dict of this submodule's parameters (keys {keys[:6]}), got {describe(value)}.",
    )
