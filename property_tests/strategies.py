"""Hypothesis strategies for random Taktiny modules: their classes, instances and placements.

`models(devices)` draws a :class:`Case`: a module built from freshly made classes, up to four
levels of modules below the root, with a description of how it was built that Hypothesis
prints in full for a failing example. Fields hold arrays (float32, bfloat16, float16, int8,
int32, bool; 0-d and zero-size included), ``None`` (Linear without bias), modules, lists, tuples
and dicts of them, static configuration of every kind, and Python scalars forced into the data
with ``field(static=False)``. Classes come in three styles:

- ``declared``: annotations, ``nn.field(...)`` options and the generated ``__init__``;
- ``assigned``: no annotations, ``__init__`` assigns attributes. These classes are shared inside
  one model, so one class may get several layouts, hence hidden subclasses;
- ``mixed``: some fields declared, and an ``__init__`` that assigns the others.

All arrays of a model live in one placement (`property_tests.arrays`), mostly a mesh with a
random PartitionSpec per array. `revalued` and `replaced` give the same structure with new
values or a new placement. Strategies over states are in `property_tests.selections`.

Fields may also hold a custom PyTree parameter (`Scaled`: a ``value`` and a ``scale`` array, as
a quantized weight keeps them), which the nested state keeps whole and the flat state lists
as ``name.value`` and ``name.scale``; `checks.flatten_by_path` flattens it by its key paths.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from taktiny import nn

from .arrays import Placement, arrays, describe, place, placements

MAX_DEPTH = 4  # levels of modules below the root
MAX_LEAVES = 24  # arrays per model, to keep examples fast
MAX_MODULES = 12
FIELD_NAMES = ("kernel", "bias", "scale", "layers", "head", "blocks", "norm", "steps", "act")
FIELD_NAMES += ("dim", "name", "cfg", "embedding", "w")
DICT_KEYS = ("a", "b", "0", "1", "2", "9", "10", "query", "value", "_", "", "é")
CLASS_NAMES = ("Block", "Layer", "Stack")  # the shared classes of the `assigned` style
# Static configuration of every kind: ints, floats, bools, strings, callables, dtypes, tuples,
# and lists/dicts of plain values (the callables are shared objects, so equal across draws).
STATICS = (3, -1, 0.5, True, "relu", "", jax.nn.relu, jnp.tanh, jnp.float32)
STATICS += (jnp.dtype("int8"), jnp.bfloat16, (1, 2), ("a", 3), (), [1, 2], {"depth": 2})
FORCED = (3, -2, 0.5, False)  # Python scalars forced into the data with field(static=False)
# The kinds of data fields, repeated to weight them (shrinking goes to the first); fields of
# the kind "static" hold static configuration
KINDS = ("array", "module", "list", "array", "dict", "module", "none", "tuple", "forced")
KINDS += ("custom",)
_CONTAINED = ("array", "module", "none", "array", "list", "dict")  # inside a list, tuple or dict


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Scaled:
    """A custom PyTree parameter: two arrays, named ``value`` and ``scale`` by key path."""

    value: Any
    scale: Any


class Case:
    """A drawn module, where its arrays live, and the description Hypothesis prints for it
    (how it was built: each class's style and options, each array's dtype, shape, sharding)."""

    def __init__(self, model: Any, placement: Placement, text: str):
        self.model = model
        self.placement = placement
        self.text = text

    def __repr__(self) -> str:
        return self.text


@dataclasses.dataclass
class _Build:
    """What the construction of one model shares: placement, budgets, shared classes."""

    placement: Placement
    allow_empty: bool
    leaves: int = 0
    modules: int = 0
    classes: dict[str, type] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def _keeping_random_state() -> Iterator[None]:
    """Restores the global `random` state after building modules. In tests, beartype checks
    taktiny's annotations and samples container items with `random`; Hypothesis rejects
    strategies that change that state (and the draws themselves never use it)."""
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)


def _assigning_init(self: Any, **fields: Any) -> None:
    """The ``__init__`` of `assigned` and `mixed` classes: assigns its arguments in order."""
    for key, value in fields.items():
        setattr(self, key, value)


@st.composite
def _item(draw: Any, build: _Build, depth: int, kinds: tuple[str, ...]) -> tuple[str, Any, str]:
    """One field value or container element: its kind, value and description."""
    if build.leaves >= MAX_LEAVES:
        kinds = tuple(k for k in kinds if k in ("none", "static", "forced"))
    if build.modules >= MAX_MODULES or depth == 0:
        kinds = tuple(k for k in kinds if k not in ("module", "list", "tuple", "dict"))
    kind = draw(st.sampled_from(kinds or ("none",)))
    if kind == "array":
        build.leaves += 1
        x = draw(arrays(build.placement, allow_empty=build.allow_empty))
        return kind, x, describe(x)
    if kind == "none":
        return kind, None, "None"
    if kind == "custom":
        build.leaves += 2
        value = draw(arrays(build.placement, dtype=jnp.int8, allow_empty=build.allow_empty))
        scale = draw(arrays(build.placement, dtype=jnp.float32, allow_empty=build.allow_empty))
        return kind, Scaled(value, scale), f"Scaled({describe(value)}, {describe(scale)})"
    if kind in ("static", "forced"):
        value = draw(st.sampled_from(STATICS if kind == "static" else FORCED))
        return kind, value, getattr(value, "__name__", None) or repr(value)
    if kind == "module":
        return (kind, *draw(_module(build, depth - 1)))
    if kind == "dict":
        keys = draw(st.lists(st.sampled_from(DICT_KEYS), max_size=3, unique=True))
        items = {key: draw(_item(build, depth - 1, _CONTAINED)) for key in keys}
        text = ", ".join(f"{key!r}: {t}" for key, (_, _, t) in items.items())
        return kind, {key: v for key, (_, v, _) in items.items()}, f"{{{text}}}"
    items = [draw(_item(build, depth - 1, _CONTAINED)) for _ in range(draw(st.integers(0, 3)))]
    values, text = [v for _, v, _ in items], ", ".join(t for _, _, t in items)
    return (kind, values, f"[{text}]") if kind == "list" else (kind, tuple(values), f"({text})")


@st.composite
def _module(
    draw: Any, build: _Build, depth: int, *, spine: bool = False, first_array: bool = False
) -> tuple[Any, str]:
    """A module of a random style with one to five fields, and its description. On the
    `spine` (the root, its first module field, and so on) modules nest `depth` deep."""
    build.modules += 1
    style = draw(st.sampled_from(("declared", "assigned", "mixed")))
    size = 2 if first_array else 1
    names = draw(st.lists(st.sampled_from(FIELD_NAMES), min_size=size, max_size=5, unique=True))
    leads = ["array"] * first_array + ["spine"] * (spine and depth > 0)
    # up to two fields hold static configuration, never the first or a leading one
    statics = set(draw(st.lists(st.integers(0, len(names) - 1), max_size=2)))
    statics -= set(range(max(len(leads), 1)))
    data = KINDS if style != "assigned" else tuple(k for k in KINDS if k != "forced")
    fields = []
    for i, name in enumerate(names):
        if i < len(leads) and leads[i] == "spine":
            fields.append((name, "module", *draw(_module(build, depth - 1, spine=True))))
            continue
        kinds = (leads[i],) if i < len(leads) else ("static",) if i in statics else data
        fields.append((name, *draw(_item(build, depth, kinds))))
    if style == "assigned":
        name = draw(st.sampled_from(CLASS_NAMES))
        if name not in build.classes:
            namespace = {"__init__": _assigning_init, "__module__": __name__}
            build.classes[name] = type(name, (nn.Module,), namespace)
        model = build.classes[name](**{field: value for field, _, value, _ in fields})
        shown = ", ".join(f"{field}={text}" for field, _, _, text in fields)
        return model, f"{name}[assigned]({shown})"
    return draw(_declared(build, style, fields))


@st.composite
def _declared(draw: Any, build: _Build, style: str, fields: list[tuple]) -> tuple[Any, str]:
    """A module of the `declared` or `mixed` style holding `fields`, and its description."""
    name = f"M{len(build.classes)}"
    build.classes[name] = nn.Module  # reserves the name
    annotations: dict[str, Any] = {}
    namespace: dict[str, Any] = {"__annotations__": annotations, "__module__": __name__}
    if style == "mixed":
        namespace["__init__"] = _assigning_init
    # fields with defaults must come last in a generated signature; any may have one in `mixed`
    defaults_from = draw(st.integers(0, len(fields))) if style == "declared" else 0
    kwargs, shown = {}, []
    for i, (field, kind, value, text) in enumerate(fields):
        if style == "mixed" and kind != "forced" and draw(st.booleans()):
            kwargs[field] = value  # an undeclared field, assigned in __init__
            shown.append(f"{field}={text} <undeclared>")
            continue
        annotations[field] = Any
        # field(static=True) only on plain config; static=False forces scalars into the data
        statics = (None, False) if kind not in ("static", "none") else (None, True)
        static = False if kind == "forced" else draw(st.sampled_from(statics))
        defaults = ("value", "factory") if style == "declared" else ("none", "value", "factory")
        default = draw(st.sampled_from(defaults)) if i >= defaults_from else "none"
        spec: dict[str, Any] = {"default": value} if default == "value" else {}
        if default == "factory":
            spec["default_factory"] = lambda value=value: value
        if static is not None or default == "factory" or (spec and draw(st.booleans())):
            namespace[field] = nn.field(static=static, **spec)
        elif spec:
            namespace[field] = value  # a plain class-level default
        note = f"static={static}" + (
            f", default by {default}" if spec or default == "factory" else ""
        )
        if default in ("value", "factory") and draw(st.booleans()):
            note += ", omitted"
        else:
            kwargs[field] = value
        shown.append(f"{field}={text} <{note}>")
    model = type(name, (nn.Module,), namespace)(**kwargs)
    return model, f"{name}[{style}]({', '.join(shown)})"


@st.composite
def models(draw: Any, devices: list[Any], *, allow_empty: bool = True, min_leaves: int = 0) -> Case:
    """A random module on `devices`: a :class:`Case` with the module and its description.

    Args:
        devices: the devices (of one platform) its arrays may live on.
        allow_empty: whether arrays may have zero elements (Orbax cannot save them).
        min_leaves: 1 makes the root's first field an array (Orbax cannot save ``{}``).
    """
    placement = draw(placements(devices))
    build = _Build(placement, allow_empty)
    depth = draw(st.integers(0, MAX_DEPTH))
    with _keeping_random_state():
        model, text = draw(_module(build, depth, spine=True, first_array=min_leaves > 0))
    return Case(model, placement, f"placement: {placement}\nmodel: {text}")


@st.composite
def revalued(draw: Any, model: Any) -> Any:
    """`model` with new random values in every array; dtypes, shapes and shardings kept."""

    def new(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        host = draw(arrays(None, shape=x.shape, dtype=x.dtype))
        return place(host, x.sharding if x.committed else None, next(iter(x.devices())))

    with _keeping_random_state():
        return jax.tree.map(new, model)


@st.composite
def replaced(draw: Any, model: Any, devices: list[Any]) -> tuple[Any, Placement]:
    """`model` with the same values in a newly drawn placement, and that placement."""
    placement = draw(placements(devices))

    def move(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        sharding = draw(placement.shardings(x.shape))
        return place(np.asarray(x), sharding, placement.device)  # via the host: same values

    with _keeping_random_state():
        return jax.tree.map(move, model), placement
