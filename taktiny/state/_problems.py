"""The problems of a state's walk, and `StateDictError`, the `ProblemsError` that lists a
load's `StateProblem` records (``taktiny._problems``).

Each kind of problem is built by exactly one function (its builder); a load collects them
and raises one `StateDictError` listing them all. The builders come in four groups: names
and structure (unknown names, with the closest valid name as a suggestion; bad keys; a dict
where an array belongs), values (not an array; a shape or dtype kind that differs; a cast
that would change values; an array outside its leaf's mesh), quantized arrays (a float
array where the model holds a `QArray` or the reverse; parts that make none) and stacks of
layers (a stack where the model holds a list, or the reverse). A selection's problems are
`_selection.py`'s; those a checkpoint's headers show, the load's (`taktiny.loading`).
"""

from __future__ import annotations

import dataclasses
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


# --- Quantized arrays --------------------------------------------------------

_MATCH = "match_quantization=True"  # the load option that converts representations


def _quantize_call(q: QArray) -> str:
    """The `tt.quantize` call that quantizes a float model's layer as `q` is."""
    group = "" if q.group_size is None else f", group_size={q.group_size}"
    return f"tt.quantize(model, bits={q.bits}{group})"


def parts_text(parts: Mapping[str, Any]) -> str:
    """A `{"value", "scale"}` dict of a quantized array's parts, as a message names it."""
    shown = ", ".join(
        f"{part} {np.dtype(v.dtype).name}{list(v.shape)}"
        if hasattr(v, "shape") and hasattr(v, "dtype")
        else f"{part} of type {type(v).__name__}"
        for part, v in parts.items()
    )
    return f"the parts of a quantized array ({shown})"


def quantized_expected(name: str, old: QArray, got: Any) -> StateProblem:
    """A float array, or a QArray quantized another way, where the model holds `old`."""
    if isinstance(got, QArray):
        hint = (
            f"the model holds {old!r} here and the state {got!r}: quantized another way. Pass "
            f"{_MATCH} to re-quantize it on load as the model's is (dequantized, then rounded "
            f"again), or load it into a model quantized as the state is ({_quantize_call(got)})."
        )
    else:
        hint = (
            f"the model holds a quantized array here, {old!r}, and the state {describe(got)}: "
            f"the representations differ. Pass {_MATCH} to quantize it on load as the model's is, "
            f"or load it into the float model and quantize that (tt.quantize)."
        )
    return StateProblem("representation", name, repr(old), describe(got), hint)


def not_float(name: str, old: QArray, got: Any) -> StateProblem:
    """A value of another kind than float, to be quantized as the model's `old` is."""
    hint = (
        f"cannot quantize {describe(got)} on load as the model's {old!r} is: quantizing "
        f"takes a float array."
    )
    return StateProblem("dtype", name, repr(old), describe(got), hint)


def not_quantized(name: str, old: QArray, got: Any) -> StateProblem:
    """A value that is neither an array nor a QArray where the model holds `old`."""
    hint = (
        f"expected a QArray like the model's {old!r} (or a dict of its parts, or a float "
        f"array to quantize with {_MATCH}), got {describe(got)}."
    )
    return StateProblem("structure", name, repr(old), describe(got), hint)


def float_expected(name: str, old: Any, got: Any, layout: QArray) -> StateProblem:
    """A QArray, or a dict of its parts, where the model holds the array `old`; `layout`:
    the QArray given, or the one its parts make."""
    given = (
        parts_text(cast("Mapping[str, Any]", got)) if isinstance(got, Mapping) else describe(got)
    )
    hint = (
        f"the model holds {describe(old)} here and the state {given}: the representations "
        f"differ. Pass {_MATCH} to dequantize it on load, or quantize the model first to keep "
        f"it quantized ({_quantize_call(layout)})."
    )
    return StateProblem("representation", name, describe(old), given, hint)


def unfit_parts(name: str, got: Mapping[str, Any], why: str) -> StateProblem:
    """Parts of a quantized array that make no QArray, so cannot be dequantized."""
    given = parts_text(got)
    hint = f"cannot dequantize {given}: {why}."
    return StateProblem("representation", name, "a value and a scale", given, hint)


def quantized_problem(problem: StateProblem, param: str, q: QArray) -> StateProblem:
    """`problem`, about a part of the QArray `q` at `param`, told as a problem with `q`."""
    part = problem.name[len(param) + 1 :]
    how = (
        f"A checkpoint quantized another way loads whole, as tt.QArray(value, scale, bits=..., "
        f"axis=..., group_size=...), with {_MATCH}, which re-quantizes it as the model's is; "
        f"or quantize the float model as the checkpoint is."
    )
    got = _dtype(problem.got) if problem.kind == "dtype" and part == "value" else None
    if got is not None and jnp.issubdtype(got, jnp.integer):
        hint = (
            f"the value of {param!r}, {q!r}, holds {problem.expected} ({_a(q.bits)}-bit "
            f"quantization); got {got.name}, the integers of another one "
            f"({jnp.iinfo(got).bits}-bit), which a cast would not re-scale. {how}"
        )
    elif got is not None and jnp.issubdtype(got, jnp.floating):
        hint = (
            f"the value of {param!r}, {q!r}, holds {problem.expected} ({_a(q.bits)}-bit "
            f"quantization); got {got.name}, a float array where the quantized integers "
            f"belong. Give the float weight itself at {param!r}, with {_MATCH}, to quantize it "
            f"on load as the model's is."
        )
    elif problem.kind == "shape" and part == "scale":
        per = "one per channel" if q.group_size is None else f"one per group of {q.group_size}"
        hint = (
            f"the scale of {param!r}, {q!r}, has shape {problem.expected} ({per} along axis "
            f"{q.axis}), got {problem.got}: the scales of another layout. {how}"
        )
    else:
        hint = f"{problem.hint} (It is the {part} of {param!r}, {q!r}.)"
    return dataclasses.replace(problem, hint=hint)


def _a(bits: int) -> str:
    return f"an {bits}" if bits == 8 else f"a {bits}"


def _dtype(name: Any) -> Any:
    """The dtype of a name a problem holds (``"int4"`` too); None for another value."""
    try:
        return jnp.dtype(name)
    except TypeError:
        return None


# --- Stacks of layers ---------------------------------------------------------
# A stack given where the model holds a list of layers, or the reverse; per-layer names
# where the model's stack holds fewer; a layer left out of an abstract model's stack.


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


def _layers(path: str, count: int) -> str:
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
        f"holds a list of {count} layers, {_layers(path, count)}. Give the stacked model's "
        f"state per layer, named as a list names its layers ({fix}), or hold the model's "
        f"layers in an nn.Stack."
    )
    if layers is not None and layers != count:
        hint += f" The counts differ too: {layers} layers against {count}."
    expected = f"a list of {count} layers ({_layers(path, count)})"
    return StateProblem("structure", path, expected, f"{stack} ('{stacked}.…')", hint)


def beyond_stack(path: str, block: str, layers: int, count: int, source: str) -> StateProblem:
    """Per-layer names of `layers` layers at `path`, where the model's stack there holds
    `count` < `layers` (its block's leaves `block`.<rest>)."""
    holds = _whose(source)[0]
    extra = "layer" if layers == count + 1 else "layers"
    left = str(count) if layers == count + 1 else f"{count} … {layers - 1}"
    hint = (
        f"{holds} holds {layers} layers at {path!r}, per layer ({_layers(path, layers)}); "
        f"the model holds a stack of {count} layers there (names '{block}.…' with a leading "
        f"layer axis of {count}). Per-layer names load into a stack, as many layers as it "
        f"holds: make the model's nn.Stack of {layers} layers, or leave out {extra} {left}."
    )
    expected = f"a stack of {count} layers ('{block}.…')"
    return StateProblem("structure", path, expected, f"{layers} layers, per layer", hint)


def layer_without_value(name: str, stacked: str, given: list[int]) -> StateProblem:
    shown = ", ".join(map(str, given[:8])) + (", ..." if len(given) > 8 else "")
    return StateProblem(
        "abstract",
        name,
        "a value",
        None,
        f"not supplied, while layers {shown} of {stacked!r} are: the model is abstract, so "
        f"this layer has no value to keep; give every layer, or load into a concrete model.",
    )
