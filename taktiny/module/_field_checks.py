"""Checks on a module's fields when it is built: values that would otherwise be kept
silently wrong (parameters hidden in functions, parameters held twice, bad dict keys)."""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator, Mapping
from typing import Any

import jax
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

_DEPTH = 4  # how deep to look inside a function for a module it holds


def _inside(value: Any) -> Iterator[tuple[str, Any]]:
    """What a function holds that a module could hide in, each with how it holds it."""
    if isinstance(value, types.MethodType):
        yield "as the object of a bound method", value.__self__
        yield "in a bound method", value.__func__
    elif isinstance(value, functools.partial):
        for held in (value.func, *value.args, *value.keywords.values()):
            yield "inside functools.partial", held
    elif isinstance(value, (list, tuple)):
        for held in value:
            yield "in a container", held
    elif isinstance(value, Mapping):
        for held in value.values():
            yield "in a container", held
    wrapped = getattr(value, "__wrapped__", None) if callable(value) else None
    if wrapped is not None:
        yield "wrapped by a function transformation (jax.vmap, jax.jit, ...)", wrapped
    for cell in getattr(value, "__closure__", None) or ():
        try:
            yield "in a closure", cell.cell_contents
        except ValueError:  # an empty cell
            continue


def _find(
    value: Any, module_type: type, depth: int, seen: dict[int, int]
) -> tuple[str, Any] | None:
    """The first module held in `value`, `depth` levels deep at most. `seen` maps what was
    searched to the depth it was searched to: reached again with more depth left (by a
    shorter path), it is searched again, deeper."""
    if depth <= seen.get(id(value), 0):
        return None
    seen[id(value)] = depth
    for how, held in _inside(value):
        if isinstance(held, module_type):
            return how, held
        found = _find(held, module_type, depth - 1, seen)
        if found is not None:
            return found
    return None


def hidden_module(owner: str, name: str, value: Any, obj: Any, module_type: type) -> None:
    """Raises when the static value `value` of field `name` holds a module: a bound method
    of the module being built (it would keep computing with the parameters it has now) or
    a module inside a function (its parameters would vanish from the state)."""
    if isinstance(value, types.MethodType) and value.__self__ is obj:
        method = getattr(value.__func__, "__name__", "method")
        raise TypeError(
            f"{owner}.{name} holds the bound method {owner}.{method} of the module being "
            f"built. A function is static, so the method would keep this module as it is now: "
            f"after a load or a training step it would still compute with the old parameters, "
            f"and jax.grad through it would be zero. Call the method where you need it "
            f"(self.{method}(x) in __call__) instead of storing it, or store a plain function "
            f"(self.{name} = jax.nn.gelu)."
        )
    found = _find(value, module_type, _DEPTH, {})
    if found is None:
        return
    how, module = found
    kind = type(module).__name__
    if module is obj:
        what = f"this {owner} itself ({how})"
    else:
        what = f"a {kind} module ({how})"
    raise TypeError(
        f"{owner}.{name} is a function that holds {what}. A function is static, so that "
        f"module's parameters would vanish from the state, get no gradient, and ignore loads. "
        f"Store the module itself in a field (self.{name} = layer) and apply the function "
        f"when calling it: jax.vmap(self.{name})(x), functools.partial(self.{name}, ...)(x)."
    )


def dict_keys(owner: str, name: str, path: tuple[Any, ...]) -> None:
    """Raises when a dict on `path` inside field `name` has a key that cannot name
    parameters: not a string, or containing '.' (which joins flat names)."""
    for key in path:
        if isinstance(key, DictKey) and (not isinstance(key.key, str) or "." in key.key):
            raise TypeError(
                f"{owner}.{name} has the dict key {key.key!r}. Keys of dicts inside a module "
                f"name parameters, so they must be strings without '.' (a '.' joins flat "
                f"names); rename it, e.g. {str(key.key).replace('.', '_')!r}."
            )


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        if isinstance(key, GetAttrKey):
            tree = getattr(tree, key.name)
        elif isinstance(key, SequenceKey):
            tree = tree[key.idx]
        else:
            tree = tree[key.key]  # pyright: ignore[reportAttributeAccessIssue]
    return tree


def _tied(obj: Any, first: tuple[Any, ...], second: tuple[Any, ...]) -> tuple[str, str, str]:
    """The shortest paths at which `first` and `second` (leaf paths holding the same array)
    hold the same object, and what that object is."""
    while first and second and first[-1] == second[-1]:
        if _get(obj, first[:-1]) is not _get(obj, second[:-1]):
            break
        first, second = first[:-1], second[:-1]
    held = _get(obj, first)
    kind = "array" if hasattr(held, "shape") else type(held).__name__
    return jax.tree_util.keystr(first), jax.tree_util.keystr(second), kind


def _shallow(values: list[Any]) -> set[int]:
    """The ids of `values` and of the items of the lists, tuples and dicts among them."""
    ids = set(map(id, values))
    for value in values:
        if isinstance(value, (list, tuple)):
            ids.update(map(id, value))
        elif isinstance(value, dict):
            ids.update(map(id, value.values()))
    return ids


def ties(obj: Any, owner: str, replaced: tuple[list[Any], list[Any]] | None) -> None:
    """Raises when the same array (or a module with arrays) sits at two places in `obj`:
    the state would hold it twice and the first training step would untie it.

    A newly built module is searched whole. A `replace` costs what it changes: `replaced`
    is (the new values, searched whole; the values kept), and the new values are compared
    with the kept ones and their containers' items, which finds ``m.replace(head=m.embed)``."""
    if replaced is None:
        leaves = jax.tree_util.tree_leaves(obj)
        if len({id(leaf) for leaf in leaves}) == len(leaves):
            return
    else:
        new, kept = replaced
        leaves = jax.tree_util.tree_leaves(new)
        ids = {id(leaf) for leaf in leaves}
        if len(ids) == len(leaves) and not (ids | _shallow(new)) & _shallow(kept):
            return
    seen: dict[int, tuple[Any, ...]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(obj)[0]:
        if id(leaf) in seen:
            first, second, kind = _tied(obj, seen[id(leaf)], path)
            raise TypeError(
                f"{owner}{first} and {owner}{second} are the same {kind}. A PyTree holds each "
                f"place separately, so the state would list it twice and the first training "
                f"step would untie the two. To use one parameter in two places, store it once "
                f"and use it twice: call the same submodule again, or, for an output "
                f"projection tied to an embedding, call embed.attend(x) (nn.Embed). To start "
                f"two parameters from the same values, store a copy (jnp.array(x))."
            )
        seen[id(leaf)] = path
