"""The problems of a state's walk, and `StateDictError`, the `ProblemsError` that lists a
load's `StateProblem` records (``taktiny._problems``).

Each kind of problem is built by exactly one function (its builder); a load collects them
and raises one `StateDictError` listing them all. Here are those of names and structure
(unknown names, with the closest valid name as a suggestion; bad keys; a dict where an
array belongs) and of values (not an array; a shape or dtype kind that differs; a cast that
would change values; an array outside its leaf's mesh), which several checks find. The
others sit beside the one check that finds them: another representation's in
`_represent.py`, a stack of layers' in `_layers.py`, a selection's in `_selection.py`, a
checkpoint's headers' in ``taktiny.loading``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from .._problems import ProblemsError, StateProblem, Suggester
from ..arrays import mesh_text
from ..quant import PARTS, QArray

_ORDER = {"unknown": 0, "key": 0, "structure": 0, "missing": 2, "abstract": 2}  # values: 1


class StateDictError(ProblemsError):
    """The one error type for state problems; raised once, listing every offending name.

    When it is raised nothing has been loaded: the module is unchanged and no new
    module is returned. Problems with names and structure come first (unknown names,
    bad keys, a dict where an array belongs), then problems with values (shape,
    dtype, not an array), then names that were not supplied; within each group, in
    the order of the state. The message shows the first 20; all of them are in
    :attr:`problems` (a tuple of :class:`StateProblem`), and by name in
    :attr:`missing_keys` and :attr:`unexpected_keys`.

    When almost none of the names given is the model's (at most one in ten, and three or
    more unknown: fewer are more likely typos), as in a checkpoint of another framework's
    names, the message ends by saying how to convert them: rules (:mod:`taktiny.convert`),
    their presets and the examples that hold them.

    Args:
        where: the call that failed, which starts the message
            (``"MLP.load_state_dict()"``).
        problems: every problem found, in any order.
        matched: how many of the names given are the model's, when the load counts them
            (None: not counted, and the message says nothing of conversion).

    Attributes:
        problems: the problems, ordered as above.
    """

    _unexpected = ("unknown", "key")  # the kinds of a problem with a name given

    def __init__(self, where: str, problems: Iterable[StateProblem], *, matched: int | None = None):
        ordered = sorted(problems, key=lambda p: _ORDER.get(p.kind, 1))
        unknown = sum(p.kind == "unknown" for p in ordered)
        tail: list[str] = []
        if matched is not None and unknown >= 3 and 10 * matched <= matched + unknown:
            tail.append(_renamed(matched, matched + unknown))
        super().__init__(where, ordered, "; nothing was loaded.", tail=tail)

    @property
    def missing_keys(self) -> tuple[str, ...]:
        """Names the load needed but the state did not supply."""
        return tuple(p.name for p in self.problems if p.kind in ("missing", "abstract"))

    @property
    def unexpected_keys(self) -> tuple[str, ...]:
        """Names in the state that the module does not have."""
        return tuple(p.name for p in self.problems if p.kind in self._unexpected)


def _renamed(matched: int, given: int) -> str:
    """The advice for a load whose names are almost all another naming's."""
    return (
        f"{'None' if not matched else f'Only {matched}'} of the {given} names given "
        f"{'is' if matched == 1 else 'are'} the model's: they name its parameters another "
        f"way, as PyTorch and Hugging Face checkpoints do. Convert them with rules "
        f"(taktiny.convert; docs/converting.md): load_safetensors(model, path, rules=rules), "
        f"or convert.convert(rules, state, target=model) to load the result. "
        f"convert.pytorch(model) makes the rules for a model that mirrors a torch module, "
        f"from the layer presets (convert.linear, convert.embedding, convert.layer_norm, "
        f"...); examples/bert.py, gpt2.py and llama.py hold the RULES of Hugging Face's "
        f"BERT, GPT-2 and Llama (vit.py and resnet.py: ViT and ResNet)."
    )


def describe(value: Any) -> str:
    """A value as a message names it: ``an array float32[2, 3]``, ``a dict with keys [...]``."""
    if isinstance(value, Mapping):
        return f"a dict with keys {list(cast('Mapping[Any, Any]', value))[:6]}"
    if isinstance(value, QArray):
        return f"a {value!r}"
    if isinstance(value, jax.ShapeDtypeStruct):
        return f"an abstract array {np.dtype(value.dtype).name}{list(value.shape)}"
    if isinstance(value, (jax.Array, np.ndarray)):
        array = cast("jax.Array | np.ndarray", value)
        return f"an array {np.dtype(array.dtype).name}{list(array.shape)}"
    return f"a value of type {type(value).__name__}"


# --- Names and structure -----------------------------------------------------

_SUGGESTED = 100  # unknown names that get a suggestion; later ones are only listed


def unknown(
    items: Sequence[tuple[str, Any]], names: Sequence[str], flat: bool, given: Collection[str]
) -> list[StateProblem]:
    """A problem for each (name, value) whose name has no leaf: a group of parameters, a
    child of an array, or simply unknown. Suggestions leave out the names in `given`
    (what the same state already supplies)."""
    suggest = Suggester(names, given)
    return [
        _unknown(name, value, flat, suggest, i < _SUGGESTED)
        for i, (name, value) in enumerate(items)
    ]


def _unknown(name: str, value: Any, flat: bool, names: Suggester, suggest: bool) -> StateProblem:
    if name in names.groups:
        inside = [n for n in names.names if n.startswith(name + ".")]
        listed = ", ".join(inside[:4]) + (", ..." if len(inside) > 4 else "")
        how = f"by name (e.g. {inside[0]!r})" if flat else "as a nested dict"
        return StateProblem(
            "structure",
            name,
            "a dict of parameters",
            describe(value),
            f"names a group of parameters ({listed}), not one array; got {describe(value)}. "
            f"Supply its parameters {how}.",
        )
    prefixes = (name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1))
    parent = next((p for p in prefixes if p in names.known), None)
    if parent is not None:
        return inside_array(name, parent, value)
    close = names(name) if suggest else None
    if close is not None:
        return StateProblem("unknown", name, close, name, f"unknown key; did you mean {close!r}?")
    return StateProblem(
        "unknown",
        name,
        None,
        name,
        f"unknown key; the model has no parameter of that name (it has "
        f"{list(names.names[:3])}, ...).",
    )


def inside_array(name: str, parent: str, value: Any) -> StateProblem:
    """A flat name below the name of an array (``kernel.x`` where ``kernel`` is one)."""
    entry = name[len(parent) + 1 :]
    return StateProblem(
        "structure",
        name,
        f"an array at {parent!r}",
        describe(value),
        f"{parent!r} is an array, so it has no entry {entry!r}; give the array itself at "
        f"{parent!r}"
        + (
            ", or pass match_quantization=True to dequantize a quantized array's parts on load."
            if entry in PARTS
            else "."
        ),
    )


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


def array_expected(name: str, value: Any, why: str) -> StateProblem:
    return StateProblem(
        "structure",
        name,
        "an array",
        describe(value),
        f"expected an array, got {describe(value)}; {why}.",
    )


def group_expected(name: str, keys: list[str], value: Any) -> StateProblem:
    return StateProblem(
        "structure",
        name,
        f"a dict with keys {keys[:6]}",
        describe(value),
        f"expected a dict of this submodule's parameters (keys {keys[:6]}), got {describe(value)}.",
    )


def structure(name: str, expected: Any, got: Any) -> StateProblem:
    return StateProblem(
        "structure",
        name,
        str(expected),
        str(got),
        f"expected a value structured as {expected}, got {got}.",
    )


def missing(name: str, abstract: bool = False) -> StateProblem:
    """A leaf not supplied under ``strict=True``; `abstract`: the model's leaf has no value
    (from ``jax.eval_shape``), so strict=False would not keep one."""
    if abstract:
        hint = (
            "missing: strict=True requires every parameter, and the model is abstract (from "
            "jax.eval_shape), so it has no value to keep; supply it."
        )
    else:
        hint = (
            "missing: strict=True requires every parameter; supply it, or pass strict=False to "
            "keep its current value."
        )
    return StateProblem("missing", name, "a value", None, hint)


def abstract(name: str) -> StateProblem:
    return StateProblem(
        "abstract",
        name,
        "a value",
        None,
        "not supplied, and the model is abstract (from jax.eval_shape): a load into an abstract "
        "model must supply every parameter, or it would stay unfilled.",
    )


# --- Values ------------------------------------------------------------------


def bits(name: str, expected: Any, got: Any) -> StateProblem:
    """An integer cast to or from a 4-bit dtype: quantized values of another width."""
    want, have = np.dtype(expected).name, np.dtype(got).name
    hint = (
        f"the model holds {want} here and the state {have}: integers of another width, as "
        f"quantized values of another number of bits are, which a cast would not re-scale. "
        f"Cast the value yourself (value.astype(jnp.{want})) if it really holds {want} values."
    )
    return StateProblem("dtype", name, want, have, hint)


def not_an_array(name: str, value: Any) -> StateProblem:
    if isinstance(value, jax.ShapeDtypeStruct):
        why = f"got {describe(value)} (from jax.eval_shape): restore real arrays first."
    elif value is None:  # (a dict is reported as array_expected before it gets here)
        why = "got a value of type NoneType."
    else:
        why = f"got a value that is not numeric ({value!r:.60})."
    return StateProblem(
        "value", name, "an array", type(value).__name__, f"expected an array, {why}"
    )


def shape(name: str, expected: tuple[int, ...], got: tuple[int, ...]) -> StateProblem:
    return StateProblem(
        "shape", name, expected, got, f"shape mismatch: expected {expected}, got {got}."
    )


def dtype_kind(
    name: str, expected: Any, got: Any, expected_kind: str, got_kind: str
) -> StateProblem:
    want, have = np.dtype(expected).name, np.dtype(got).name
    return StateProblem(
        "dtype",
        name,
        want,
        have,
        f"dtype kind changes: the model holds {want} ({expected_kind}), got {have} ({got_kind}). "
        f"Loads only cast within a kind; convert the value yourself if this is really intended.",
    )


def narrowing(name: str, expected: Any, got: Any, traced: bool) -> StateProblem:
    want, have = np.dtype(expected).name, np.dtype(got).name
    why = "cannot be checked inside jit" if traced else "would change values"
    hint = f"narrowing {have} to {want} {why}; convert the value yourself."
    return StateProblem("dtype", name, want, have, hint)


def overflow(
    name: str, expected: Any, got: Any, count: int, largest: float, into: str = "inf"
) -> StateProblem:
    """Values too large for a narrower float dtype, which the cast would turn `into`
    ``"inf"``, ``"nan"`` (a dtype without inf) or ``"max"`` (clipped to its largest)."""
    want, have = np.dtype(expected).name, np.dtype(got).name
    limit = float(cast("np.finfo[Any]", jnp.finfo(expected)).max)
    values = "a value" if count == 1 else f"{count} values"
    if into == "inf":
        change, holds = "turn {} into inf", ""
    elif into == "nan":
        change, holds = "turn {} into nan", " and has no inf"
    else:
        change, holds = f"clip {{}} to its largest, {limit:.4g}", " and has no inf"
    return StateProblem(
        "dtype",
        name,
        want,
        have,
        f"casting {have} to {want} would {change.format(values)}: the largest is "
        f"{largest:.4g}, and {want} holds at most {limit:.4g}{holds}. Scale or clip the value, "
        f"or keep this parameter in a wider dtype.",
    )


def _array(value: Any, noun: str = "array") -> str:
    """An array as a message names it: ``array float32[2, 3]``."""
    return f"{noun} {np.dtype(value.dtype).name}{list(value.shape)}"


def masked(name: str, value: Any) -> StateProblem:
    """A NumPy masked array, whose mask a load would drop."""
    hidden = int(np.ma.count_masked(value))  # pyright: ignore[reportUnknownMemberType, reportUnknownArgumentType]  (NumPy leaves it unannotated)
    hint = (
        f"expected a plain array, got a NumPy masked {_array(value)} with {hidden} "
        f"masked of {value.size}: a load would drop the mask. Pass value.filled(fill) to "
        f"choose what the masked entries hold, or value.data to load the data under the mask."
    )
    return StateProblem("value", name, "an array", f"a masked {_array(value)}", hint)


def leaked(name: str, value: Any) -> StateProblem:
    """A tracer that belongs to no transformation being traced now."""
    hint = (
        f"expected an array, got a {_array(value, 'tracer')} ({type(value).__name__}) that "
        f"belongs to no transformation being traced now: it leaked out of a jax.jit, vmap, grad or "
        f"make_jaxpr that has finished, so it holds no value. Load what the transformed "
        f"function returns, or load inside the transformation that made it."
    )
    return StateProblem("value", name, "an array", f"a leaked {type(value).__name__}", hint)


def deleted(name: str, value: Any) -> StateProblem:
    """A JAX array whose buffers are deleted."""
    hint = (
        f"expected an array, got a deleted {_array(value)}: its buffers were freed, by "
        f"value.delete() or by donating it to a jitted function (donate_argnums), so it holds "
        f"no values. Load the array before it is deleted, or the result of the call it was "
        f"donated to."
    )
    return StateProblem("value", name, "an array", f"a deleted {_array(value)}", hint)


def devices(name: str, shape: tuple[int, ...], got: Any, target: Any) -> StateProblem:
    """A value on devices outside the mesh of the leaf it replaces."""
    mesh = target.mesh
    axes = mesh_text(mesh)
    have = sorted(d.id for d in got.device_set)
    want = sorted(d.id for d in mesh.devices.flat)
    return StateProblem(
        "sharding",
        name,
        f"devices {want}",
        f"devices {have}",
        f"the value of shape {shape} sits on devices {have}, outside the leaf's mesh {axes} "
        f"(devices {want}, spec {target.spec}). Load host data (NumPy) or arrays on the "
        f"model's mesh: jax.device_put(value, leaf.sharding) first.",
    )
