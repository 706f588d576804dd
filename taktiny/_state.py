"""The state walk: reading a module's parameters as dicts, and loading them back.

Reading is one ``tree_flatten`` plus a cached description of the tree (the
names of its leaves and a nested template), looked up by tree structure.
Loading is one dict lookup per supplied value, a check and cast per value, one
batched ``device_put`` for the values that must move, and one unflatten.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
_Tracer = Tracer


@dataclasses.dataclass(frozen=True)
class StateProblem:
    """One problem found while loading a state.

    Attributes:
        kind: ``"unknown"``, ``"missing"``, ``"shape"``, ``"dtype"``, ``"value"``,
            ``"structure"``, ``"key"`` or ``"abstract"``.
        key: the flat name (``"layers.1.kernel"``) the problem is about.
        expected: what the model holds there (a shape, a dtype, a suggestion).
        got: what the state supplied.
        hint: how to fix it.
    """

    kind: str
    key: str
    expected: Any
    got: Any
    hint: str

    def __str__(self) -> str:
        return f"{self.key!r}: {self.hint}"


class StateDictError(ValueError):
    """The one error type for state problems; raised once, listing every offending name.

    Nothing is loaded when it is raised: the module is unchanged and no new
    module is returned. The problems are also available as :attr:`problems`
    (a tuple of :class:`StateProblem`), :attr:`missing_keys` and
    :attr:`unexpected_keys`.
    """

    def __init__(self, where: str, problems: list[StateProblem]):
        self.problems = tuple(problems)
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        lines = [f"{where}: {count}; nothing was loaded."]
        lines += [f"  - {problem}" for problem in problems]
        super().__init__("\n".join(lines))

    @property
    def missing_keys(self) -> tuple[str, ...]:
        """Names that ``strict=True`` required but the state did not supply."""
        return tuple(p.key for p in self.problems if p.kind in ("missing", "abstract"))

    @property
    def unexpected_keys(self) -> tuple[str, ...]:
        """Names in the state that the module does not have."""
        return tuple(p.key for p in self.problems if p.kind in ("unknown", "key"))


@dataclasses.dataclass(frozen=True)
class _Custom:
    """A custom PyTree parameter (a quantized weight): whole in the nested form."""

    treedef: Any
    start: int
    stop: int


@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
    names: tuple[str, ...]  # flat name of each leaf, in flatten order
    index: dict[str, int]  # name -> leaf position
    template: dict[str, Any]  # nested: key -> leaf position | sub-template | _Custom


_SPECS: dict[Any, _Spec] = {}


@functools.cache
def _array_type() -> type:
    """The concrete class of JAX arrays, for an exact-type fast path."""
    return type(jnp.zeros(()))


def _key(key: Any) -> str:
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, (DictKey, FlattenedIndexKey)):
        return str(key.key)
    return str(key)


def _make_spec(model: Any) -> _Spec:
    from ._module import Module

    def is_param(x: Any) -> bool:
        return x is not None and not isinstance(x, (Module, list, tuple, dict))

    template: dict[str, Any] = {}
    names: list[str] = []
    for path, value in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_param)[0]:
        keys = [_key(k) for k in path]
        node = template
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        inner, treedef = jax.tree_util.tree_flatten_with_path(value)
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # an array
            node[keys[-1]] = len(names)
        elif inner:
            node[keys[-1]] = _Custom(treedef, len(names), len(names) + len(inner))
        names += [".".join(keys + [_key(k) for k in sub]) for sub, _ in inner]
    return _Spec(tuple(names), {name: i for i, name in enumerate(names)}, template)


def _flatten(model: Any) -> tuple[list[Any], Any, _Spec]:
    leaves, treedef = jax.tree_util.tree_flatten(model)
    spec = _SPECS.get(treedef)
    if spec is None:
        if len(_SPECS) >= 4096:
            _SPECS.clear()
        spec = _SPECS[treedef] = _make_spec(model)
    return leaves, treedef, spec


def _build(template: dict[str, Any], leaves: list[Any]) -> dict[str, Any]:
    return {
        key: leaves[child]
        if type(child) is int
        else _build(child, leaves)
        if type(child) is dict
        else child.treedef.unflatten(leaves[child.start : child.stop])
        for key, child in template.items()
    }


def state_dict(model: Any) -> dict[str, Any]:
    leaves, _, spec = _flatten(model)
    return _build(spec.template, leaves)


def flat_state_dict(model: Any) -> dict[str, Any]:
    leaves, _, spec = _flatten(model)
    return dict(zip(spec.names, leaves))


# --- loading ---------------------------------------------------------------------------


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"a dict with keys {list(value)[:6]}"
    if isinstance(value, ARRAY_TYPES):
        return f"an array {value.dtype}{list(value.shape)}"
    return f"a value of type {type(value).__name__}"


def _unknown(name: str, spec: _Spec, value: Any, flat: bool) -> StateProblem:
    """The problem for a name the module has no leaf for: a group, a leaf's child, or unknown."""
    inside = [n for n in spec.names if n.startswith(name + ".")]
    if inside:
        return StateProblem(
            "structure",
            name,
            "a dict of parameters",
            _describe(value),
            f"names a group of parameters ({', '.join(inside[:4])}"
            f"{', ...' if len(inside) > 4 else ''}), not one array; got {_describe(value)}. "
            "Supply its parameters by name"
            + (f" (e.g. {inside[0]!r})" if flat else " as a nested dict")
            + ".",
        )
    parent = next((n for n in spec.names if name.startswith(n + ".")), None)
    if parent is not None:
        return StateProblem(
            "structure",
            name,
            f"an array at {parent!r}",
            _describe(value),
            f"{parent!r} is an array, so it has no entry {name[len(parent) + 1 :]!r}; give the "
            f"array itself at {parent!r}.",
        )
    groups = {n.rsplit(".", k)[0] for n in spec.names for k in range(1, n.count(".") + 1)}
    close = difflib.get_close_matches(name, [*spec.names, *sorted(groups)], n=1, cutoff=0.6)
    hint = (
        f"unknown key; did you mean {close[0]!r}?"
        if close
        else "unknown key; the model has "
        f"no parameter of that name (its names start {list(spec.names[:3])})."
    )
    return StateProblem("unknown", name, close[0] if close else None, name, hint)


def _collect(
    template: dict[str, Any],
    state: Mapping[str, Any],
    prefix: str,
    supplied: dict[int, Any],
    problems: list[StateProblem],
    spec: _Spec,
) -> None:
    """Walks a nested state along the template, gathering leaf position -> value."""
    array_type = _array_type()
    for key, value in state.items():
        child = template.get(key)
        if type(child) is int:
            if type(value) is array_type or not isinstance(value, Mapping):
                supplied[child] = value
            else:
                name = f"{prefix}{key}"
                problems.append(
                    StateProblem(
                        "structure",
                        name,
                        "an array",
                        _describe(value),
                        f"expected an array, got {_describe(value)}; this name is one parameter, "
                        f"not a group.",
                    )
                )
            continue
        name = f"{prefix}{key}"
        if type(child) is dict:
            if type(value) is dict or isinstance(value, Mapping):
                _collect(child, value, name + ".", supplied, problems, spec)
            else:
                problems.append(
                    StateProblem(
                        "structure",
                        name,
                        f"a dict with keys {list(child)[:6]}",
                        _describe(value),
                        f"expected a dict of this submodule's parameters (keys {list(child)[:6]}), "
                        f"got {_describe(value)}.",
                    )
                )
        elif child is not None:  # a custom PyTree parameter, given whole
            inner, treedef = jax.tree_util.tree_flatten(value)
            if treedef != child.treedef:
                problems.append(
                    StateProblem(
                        "structure",
                        name,
                        str(child.treedef),
                        str(treedef),
                        f"expected a value structured as {child.treedef}, got {treedef}.",
                    )
                )
            else:
                supplied.update(zip(range(child.start, child.stop), inner))
        elif isinstance(key, str) and "." in key:
            problems.append(
                StateProblem(
                    "key",
                    name,
                    "a key without '.'",
                    key,
                    "nested state keys must not contain '.'; nest it as a dict, or pass dotted "
                    "names to load_flat_state_dict().",
                )
            )
        else:
            problems.append(
                _unknown(
                    name if isinstance(key, str) else f"{prefix}{key!r}", spec, value, flat=False
                )
            )


_KINDS = (
    ("floating", jnp.floating),
    ("complex", jnp.complexfloating),
    ("signed integer", jnp.signedinteger),
    ("unsigned integer", jnp.unsignedinteger),
    ("bool", jnp.bool_),
)


def _kind(dtype: Any) -> str:
    return next((name for name, kind in _KINDS if jnp.issubdtype(dtype, kind)), str(dtype))


def _cast(name: str, value: Any, dtype: Any, problems: list[StateProblem]) -> Any:
    """`value` cast to `dtype` within its kind, or None after recording why it can't be."""
    source, target = _kind(value.dtype), _kind(dtype)
    if source != target:
        problems.append(
            StateProblem(
                "dtype",
                name,
                np.dtype(dtype).name,
                np.dtype(value.dtype).name,
                f"dtype kind changes: the model holds {np.dtype(dtype).name} ({target}), got "
                f"{np.dtype(value.dtype).name} ({source}). Loads only cast within a kind; convert "
                f"the value yourself if this is really intended.",
            )
        )
        return None
    if "integer" in target and jnp.iinfo(dtype).bits < jnp.iinfo(value.dtype).bits:
        info = jnp.iinfo(dtype)
        in_range = (
            None
            if isinstance(value, _Tracer)
            else (
                value.size == 0 or (int(value.min()) >= info.min and int(value.max()) <= info.max)
            )
        )
        if not in_range:
            problems.append(
                StateProblem(
                    "dtype",
                    name,
                    np.dtype(dtype).name,
                    np.dtype(value.dtype).name,
                    f"narrowing {np.dtype(value.dtype).name} to {np.dtype(dtype).name} "
                    + (
                        "cannot be checked inside jit"
                        if in_range is None
                        else "would change values"
                    )
                    + "; convert the value yourself.",
                )
            )
            return None
    return value.astype(dtype)


def _convert(name: str, value: Any, old: Any, problems: list[StateProblem]) -> Any:
    """Checks `value` against the leaf `old` it replaces and casts it; None on a problem."""
    if not isinstance(value, (jax.Array, np.ndarray)):
        if isinstance(value, (Mapping, jax.ShapeDtypeStruct)) or value is None:
            problems.append(
                StateProblem(
                    "value",
                    name,
                    "an array",
                    _describe(value),
                    f"expected an array, got {_describe(value)}"
                    + (
                        " (an abstract value: restore real arrays first)."
                        if isinstance(value, jax.ShapeDtypeStruct)
                        else "."
                    ),
                )
            )
            return None
        try:
            array = np.asarray(value)
        except Exception:  # noqa: BLE001 - any failure means "not an array"
            array = None
        if array is None or array.dtype.kind in "OUSM":
            problems.append(
                StateProblem(
                    "value",
                    name,
                    "an array",
                    type(value).__name__,
                    f"expected an array, got a value that is not numeric ({value!r:.60}).",
                )
            )
            return None
        value = array
    if value.shape != old.shape:
        problems.append(
            StateProblem(
                "shape",
                name,
                tuple(old.shape),
                tuple(value.shape),
                f"shape mismatch: expected {tuple(old.shape)}, got {tuple(value.shape)}.",
            )
        )
        return None
    if value.dtype != old.dtype:
        value = _cast(name, value, old.dtype, problems)
    return value


def _shared(value: Any, given: Any, target: Any) -> bool:
    """Whether placing NumPy `value` on `target` (None: the default device) could leave the
    loaded leaf sharing memory with an array the caller still holds (`given` itself, or
    what it views, like a torch tensor's `.numpy()`). On CPU, jax.device_put shares
    aligned host buffers, even with may_alias=False, so a later write to the caller's
    array would silently change the loaded model."""
    if not isinstance(value, np.ndarray) or (value is not given and value.flags.owndata):
        return False
    devices = target.device_set if target is not None else jax.devices()[:1]
    return any(device.platform == "cpu" for device in devices)


def load(model: Any, state: Any, *, strict: bool, flat: bool) -> Any:
    method = "load_flat_state_dict" if flat else "load_state_dict"
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{type(model).__name__}.{method}() expects a dict, got {type(state).__name__}."
        )
    leaves, treedef, spec = _flatten(model)
    problems: list[StateProblem] = []
    supplied: dict[int, Any] = {}
    if flat:
        for name, value in state.items():
            i = spec.index.get(name)
            if i is None:
                problems.append(_unknown(str(name), spec, value, flat=True))
            elif isinstance(value, Mapping):
                problems.append(
                    StateProblem(
                        "structure",
                        name,
                        "an array",
                        _describe(value),
                        f"expected an array, got {_describe(value)}; flat states map names to "
                        f"arrays.",
                    )
                )
            else:
                supplied[i] = value
    else:
        _collect(spec.template, state, "", supplied, problems, spec)

    new = list(leaves)
    moves: list[tuple[int, Any, Any]] = []  # values that must be placed like the leaf they replace
    array_type = _array_type()
    for i, value in supplied.items():
        old = leaves[i]
        if type(value) is array_type and type(old) is array_type and value.aval == old.aval:
            have, want = value.sharding, old.sharding  # the common case: same shape and dtype
            if have is want or have == want:
                new[i] = value
            else:
                moves.append((i, value, want))
            continue
        given, value = value, _convert(spec.names[i], value, old, problems)
        if value is None:
            continue
        if isinstance(old, _Tracer) or isinstance(value, _Tracer):  # inside jit: no placement
            new[i] = jnp.asarray(value)
            continue
        target = getattr(old, "sharding", None)
        if target is not None and isinstance(value, jax.Array) and value.sharding == target:
            new[i] = value
        else:
            if _shared(value, given, target):
                value = value.copy()
            moves.append((i, value, target))

    if len(supplied) < len(leaves):
        absent = [i for i in range(len(leaves)) if i not in supplied]
        if strict:
            problems += [
                StateProblem(
                    "missing",
                    spec.names[i],
                    "a value",
                    None,
                    "missing: strict=True requires every parameter; supply it, or pass "
                    "strict=False to keep its current value.",
                )
                for i in absent
            ]
        else:
            problems += [
                StateProblem(
                    "abstract",
                    spec.names[i],
                    "a value",
                    None,
                    "not supplied, and the model is abstract (from jax.eval_shape): a load into an "
                    "abstract model must supply every parameter, or it would stay unfilled.",
                )
                for i in absent
                if isinstance(leaves[i], jax.ShapeDtypeStruct)
            ]
    if problems:
        raise StateDictError(f"{type(model).__name__}.{method}()", problems)

    placed = [i for i, _, target in moves if target is not None]
    if placed:
        arrays = jax.device_put(
            [v for _, v, t in moves if t is not None], [t for _, _, t in moves if t is not None]
        )
        for i, array in zip(placed, arrays):
            new[i] = array
    default = [(i, v) for i, v, target in moves if target is None]
    if default:
        for (i, _), array in zip(default, jax.device_put([v for _, v in default])):
            new[i] = array
    return treedef.unflatten(new)
