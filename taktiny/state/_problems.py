"""The problems of a state's walk, and `StateDictError`, the `ProblemsError` that lists a
load's `StateProblem` records (``taktiny._problems``).

Each kind of problem is built by exactly one function (its builder); a load collects them
and raises one `StateDictError` listing them all. Here are the builders several checks
share: unknown names (with the closest valid name as a suggestion), a dict where an array
belongs, a shape or dtype kind that differs, an array deleted or outside its leaf's mesh,
a leaf not supplied (the streaming load's headers show these too). The others sit beside
the one check that finds them: a name's or a key's in `_resolve.py`, a value's in
`_values.py`, another representation's in `_represent.py`, a stack of layers' in
`_layers.py`, a selection's in `_selection.py`, a checkpoint's headers' in
``taktiny.loading``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np

from .._problems import ProblemsError, StateProblem, Suggester
from ..arrays import mesh_text
from ..quant import PARTS, Parameter

_ORDER = {"unknown": 0, "key": 0, "structure": 0, "missing": 2, "abstract": 2}  # values: 1


class StateDictError(ProblemsError):
    """The one error type for state problems; raised once, listing every offending name.

    When it is raised nothing has been loaded: the module is unchanged and no new
    module is returned. Problems with names and structure come first (unknown names,
    bad keys, a dict where an array belongs), then problems with values (shape,
    dtype, not an array), then names that were not supplied; within each group, in
    the order of the state. The message shows the first 20; all of them are in
    ``problems`` (a tuple of :class:`StateProblem`), and by name in
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
    if isinstance(value, Parameter):
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


def array_expected(name: str, value: Any, why: str) -> StateProblem:
    return StateProblem(
        "structure",
        name,
        "an array",
        describe(value),
        f"expected an array, got {describe(value)}; {why}.",
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


def array_text(value: Any, noun: str = "array") -> str:
    """An array as a message names it: ``array float32[2, 3]``."""
    return f"{noun} {np.dtype(value.dtype).name}{list(value.shape)}"


def deleted(name: str, value: Any) -> StateProblem:
    """A JAX array whose buffers are deleted."""
    hint = (
        f"expected an array, got a deleted {array_text(value)}: its buffers were freed, by "
        f"value.delete() or by donating it to a jitted function (donate_argnums), so it holds "
        f"no values. Load the array before it is deleted, or the result of the call it was "
        f"donated to."
    )
    return StateProblem("value", name, "an array", f"a deleted {array_text(value)}", hint)


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
