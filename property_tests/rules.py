"""Sharding rules drawn from a module's flat names, and brute-force oracles for them.

`rule_lists` draws ordered ``(pattern, spec)`` rules for ``tt.shard`` and ``tt.sharding_plan``:
patterns made from the module's own names (the name itself, a part replaced by ``*``, a part cut
short by ``*``, a character replaced by ``?``, ``**`` before the last part or after the first,
``**`` alone) and patterns that match nothing; each with a spec (a PartitionSpec or the tuple of
its entries) valid for the leaf its pattern was made from, and so valid or not for the other
leaves it matches. `placing_rules` draws rules that place a module validly: one exact name per
leaf, for some of the leaves.

`first_rules` and `fits` are the oracles, written from the documented rules alone: a pattern is
matched part by part with `fnmatch`, a ``**`` part standing for any number of parts; each name
takes its first matching rule; a spec fits a shape when it has no more entries than the shape
has axes, uses each mesh axis once, and its axes' sizes divide the dimensions they split.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import numpy as np
from hypothesis import strategies as st
from jax.sharding import Mesh, PartitionSpec

from .arrays import partition_specs

HOWS = ("name", "star", "cut", "question", "double star first", "double star last", "all")
HOWS += ("nothing",)
NOTHING = ("zz", "nothing.*", "**.zz", "kernel.zz.**", "?")  # ("?": no name is one letter)


def pattern_matches(pattern: str, name: str) -> bool:
    """Whether `pattern` matches the whole flat `name` (the oracle: parts and fnmatch)."""
    return _parts_match(pattern.split("."), name.split("."))


def _parts_match(pattern: list[str], name: list[str]) -> bool:
    if not pattern:
        return not name
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_parts_match(rest, name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatch.fnmatchcase(name[0], head) and _parts_match(rest, name[1:])


def as_spec(spec: Any) -> PartitionSpec:
    """A rule's spec (a PartitionSpec or the tuple of its entries) as a PartitionSpec."""
    return spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)


def first_rules(
    rules: list[tuple[str, Any]],
    names: list[str],
    params: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]] | None = None,
) -> tuple[dict[str, PartitionSpec], list[str], list[str]]:
    """Each name's spec (its first matching rule's; ``P()`` when none matches), the names no
    rule matches, and the patterns of the rules that are no name's first match, in order.

    A leaf of a custom parameter (`params`: its name -> the parameter's name, the leaf's
    shape, the parameter's shape) also takes a rule that names its parameter whole, if that
    comes first: the spec as given where the leaf has the parameter's shape, else its
    entries on the axes of the parameter's size only (none on a leaf of another rank)."""
    specs: dict[str, PartitionSpec] = {}
    unmatched, first = [], set()
    for name in names:
        param, shape, whole = (params or {}).get(name, (None, (), ()))
        matching = [name] if param is None else [name, param]
        hit = next(
            (i for i, (p, _) in enumerate(rules) if any(pattern_matches(p, n) for n in matching)),
            None,
        )
        if hit is None:
            unmatched.append(name)
            specs[name] = PartitionSpec()
        elif pattern_matches(rules[hit][0], name):
            first.add(hit)
            specs[name] = as_spec(rules[hit][1])
        else:
            first.add(hit)
            specs[name] = _of_parameter(as_spec(rules[hit][1]), shape, whole)
    unused = [pattern for i, (pattern, _) in enumerate(rules) if i not in first]
    return specs, unmatched, unused


def _of_parameter(spec: PartitionSpec, shape: tuple[int, ...], whole: tuple[int, ...]) -> Any:
    """A parameter's spec for one of its leaves (the oracle of `first_rules`)."""
    if shape == whole:
        return spec
    if len(shape) != len(whole) or len(spec) > len(whole):
        return PartitionSpec()
    entries = list(spec) + [None] * (len(whole) - len(spec))
    return PartitionSpec(
        *(e if a == b else None for e, a, b in zip(entries, shape, whole, strict=True))
    )


def fits(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> bool:
    """Whether `spec` can place an array of `shape` on `mesh`."""
    if len(spec) > len(shape):
        return False
    used: list[str] = []
    for dim, entry in zip(shape, spec, strict=False):
        axes = [a for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None]
        used += axes
        if dim % math.prod(mesh.shape[a] for a in axes):
            return False
    return len(used) == len(set(used))


def _pattern(draw: Any, name: str, how: str) -> str:
    parts = [part or "*" for part in name.split(".")]  # a pattern has no empty part
    i = draw(st.integers(0, len(parts) - 1))
    if how == "star":
        parts[i] = "*"
    elif how == "cut":
        parts[i] = parts[i][: draw(st.integers(0, len(parts[i])))] + "*"
    elif how == "question":
        j = draw(st.integers(0, len(parts[i]) - 1))
        parts[i] = parts[i][:j] + "?" + parts[i][j + 1 :]
    elif how == "double star first":
        parts = ["**", parts[-1]]
    elif how == "double star last":
        parts = [parts[0], "**"]
    elif how == "all":
        parts = ["**"]
    return ".".join(parts)


@st.composite
def _spec(draw: Any, mesh: Mesh, shape: tuple[int, ...]) -> Any:
    spec = draw(partition_specs(mesh, shape))
    return tuple(spec) if draw(st.booleans()) else spec  # the tuple form layers take too


@st.composite
def rule_lists(draw: Any, flat: dict[str, Any], mesh: Mesh) -> list[tuple[str, Any]]:
    """Up to six rules made from the names of `flat` (see the module's doc)."""
    names = list(flat)
    rules = []
    for _ in range(draw(st.integers(0, 6))):
        how = draw(st.sampled_from(HOWS)) if names else "nothing"
        if how == "nothing":
            pattern, shape = draw(st.sampled_from(NOTHING)), ()
        else:
            base = draw(st.sampled_from(names))
            pattern, shape = _pattern(draw, base, how), tuple(np.shape(flat[base]))
        rules.append((pattern, draw(_spec(mesh, shape))))
    return rules


@st.composite
def placing_rules(
    draw: Any, flat: dict[str, Any], mesh: Mesh, *, every: bool = False
) -> list[tuple[str, Any]]:
    """Rules naming some leaves of `flat` (with `every`, all it can) exactly, each with a spec
    valid for it (the names with an empty part, which no exact pattern can name, are left to
    be replicated)."""
    named = [name for name in flat if all(name.split("."))]
    chosen = [name for name in named if every or draw(st.booleans())]
    return [(name, draw(_spec(mesh, tuple(np.shape(flat[name]))))) for name in chosen]
