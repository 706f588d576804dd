"""compressed-tensors checkpoints, the format vLLM, SGLang and TensorRT-LLM serve int8 and
int4 models in: its ``pack-quantized`` layout of symmetric integer weights, one scale per
output channel or per group of input features, in and out.

A quantized ``torch.nn.Linear`` ``<module>`` (weight ``[out, in]``) is three tensors:

- ``<module>.weight_packed``: int32 ``[out, ceil(in * bits / 32)]``, the integers of each
  row offset by ``2**(bits - 1)`` (to 0..15 for 4 bits, 0..255 for 8) and packed densely
  along the row, element ``i`` in bits ``i * bits`` onward of the little-endian words;
- ``<module>.weight_scale``: float ``[out, 1]`` (per channel) or ``[out, in // group]``;
- ``<module>.weight_shape``: int64 ``[2]``, the weight's shape ``[out, in]``.

The weight is ``integers * scale`` of its channel or group, which is what a
:class:`~taktiny.QArray` quantized along the input axis holds, transposed: a kernel
``[in, out]`` with ``axis=0``. Its ``config.json`` describes the scheme under
``quantization_config`` (:func:`export_compressed_tensors` writes it). The packing and
unpacking of the integers, and the QArray made of them, are `taktiny.quant`'s.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from ..quant import INT_DTYPES, Parameter, pack_int32, packed_qarray
from ..state import host_array
from ._rules import AnyRule, Rule
from ._transforms import Transform, element_layout, identity, permutation, transpose

FORMAT = "pack-quantized"
PARTS = ("weight_packed", "weight_scale", "weight_shape")  # a module's tensors, by suffix


class unpack_quantized(Transform):
    """Makes a :class:`~taktiny.QArray` from the three tensors of one compressed-tensors
    ``pack-quantized`` module (sources ``["{m}.weight_packed", "{m}.weight_scale",
    "{m}.weight_shape"]``): the integers unpacked, bit for bit, and the scales as they
    are, both then laid out by `layout` (``transpose()`` for a ``Linear``'s ``[out, in]``
    into a kernel's ``[in, out]``), quantized along the axis the input features end on. A
    load places its parts in a quantized model as they are, or dequantizes it into a
    float one.

    The input features of a grouped weight are its groups times `group_size`. A
    per-channel row packs ``32 // bits`` integers to a word, its last word padded, so
    ``ceil(in * bits / 32)`` words hold up to ``32 // bits - 1`` input features fewer than
    they have room for: `features` says how many, by words (what the module's
    ``weight_shape`` records; :func:`quantized_rules` reads it from the checkpoint).

    Args:
        bits: 4 or 8.
        group_size: input features per scale; None for one scale per output channel.
        layout: an element transform of the weight (``identity()`` or a ``transpose``).
        features: ``{words: input features}`` for per-channel rows of that many int32
            words holding fewer input features than they have room for (``{5: 36}``: 36
            4-bit integers in 5 words); a row of any other width holds as many as it has
            room for.

    Raises:
        ValueError: `bits` is not 4 or 8, `layout` neither a rename nor a transpose, or
            `features` gives a width other input features than it can hold; called with
            other than three arrays, tensors whose shapes or dtypes do not make one
            weight of this layout, or a ``weight_shape`` that disagrees with them (a
            per-channel one naming fewer input features than the words hold, with no
            `features` for that width).
    """

    def __init__(
        self,
        bits: int,
        group_size: int | None = None,
        layout: Transform | None = None,
        *,
        features: Mapping[int, int] | None = None,
    ):
        if bits not in INT_DTYPES:
            raise ValueError(f"bits must be 4 or 8, got {bits!r}.")
        self.bits, self.group_size = int(bits), group_size
        why = ": the integers and their scales are laid out alike."
        self.layout = element_layout(layout, why)
        self.features = {int(w): int(n) for w, n in sorted((features or {}).items())}
        per = 32 // self.bits
        wrong = {w: n for w, n in self.features.items() if -(-n // per) != w or n < 1}
        if wrong or (self.features and group_size is not None):
            raise ValueError(
                f"features maps the int32 words of a per-channel row to the input features "
                f"they hold, ceil(in * {self.bits} / 32) words for in features; got "
                f"{self.features} with group_size {group_size!r}"
            )

    def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
        if len(arrays) != 3:
            raise ValueError(
                f"{self!r} takes three arrays, weight_packed, weight_scale and weight_shape, "
                f"got {len(arrays)}"
            )
        packed, scale, shape = arrays
        n = self._features(packed, scale)
        if not isinstance(shape, Tracer | jax.ShapeDtypeStruct):
            recorded = np.asarray(shape).tolist()
            if recorded != [*packed.shape[:-1], n]:
                words = packed.shape[-1]
                padded = (
                    self.group_size is None
                    and recorded[:-1] == list(packed.shape[:-1])
                    and isinstance(recorded[-1], int)
                    and -(-recorded[-1] // (32 // self.bits)) == words
                )
                fix = (
                    f"; pass features={{{words}: {recorded[-1]}}} ({words}-word rows of "
                    f"{recorded[-1]} input features), as quantized_rules does from the "
                    f"checkpoint's weight_shape"
                    if padded
                    else ""
                )
                raise ValueError(
                    f"weight_shape records {recorded}, and the packed integers "
                    f"{list(packed.shape)} with scales {list(scale.shape)} hold a weight of "
                    f"shape {[*packed.shape[:-1], n]} for {self!r}{fix}"
                )
        perm = permutation(self.layout, len(packed.shape))
        return (packed_qarray(packed, scale, self.bits, n, self.group_size, perm),)

    def _features(self, packed: Any, scale: Any) -> int:
        """The input features, from the packed integers and the scales (checked)."""
        words, groups = packed.shape[-1], scale.shape[-1]
        per = 32 // self.bits
        if self.group_size is None:
            n = self.features[words] if words in self.features else words * per
        else:
            n = groups * self.group_size
        fits = (
            np.dtype(packed.dtype) == np.int32
            and len(scale.shape) == len(packed.shape) >= 2
            and tuple(scale.shape[:-1]) == tuple(packed.shape[:-1])
            and jnp.issubdtype(scale.dtype, jnp.floating)
            and words == -(-n // per)
            and (self.group_size is not None or groups == 1)
        )
        if not fits:
            per_what = "1" if self.group_size is None else f"in // {self.group_size}"
            raise ValueError(
                f"a {self.bits}-bit pack-quantized weight is int32 [out, ceil(in * "
                f"{self.bits} / 32)] with float scales [out, {per_what}]; got "
                f"{np.dtype(packed.dtype).name}{list(packed.shape)} and "
                f"{np.dtype(scale.dtype).name}{list(scale.shape)}"
            )
        return n

    def _args(self) -> str:
        group = "" if self.group_size is None else f", group_size={self.group_size}"
        layout = "" if isinstance(self.layout, identity) else f", layout={self.layout!r}"
        features = f", features={self.features}" if self.features else ""
        return f"bits={self.bits}{group}{layout}{features}"


Layout = tuple[int, int | None]  # (bits, group_size) of a config group


def scheme(config: Mapping[str, Any]) -> list[tuple[Layout, list[str]]]:
    """The (bits, group_size) of each config group of a compressed-tensors
    ``quantization_config``, checked to be what Taktiny reads (weight-only, symmetric,
    integer, per channel or per group, 4 or 8 bits, ``pack-quantized`` and compressed),
    with the group's ``targets``. Raises ValueError naming what is out of scope."""
    where = "this compressed-tensors checkpoint"
    out = []
    wrong = {
        "format": config.get("format") not in (None, FORMAT, "mixed-precision"),
        "quantization_status": config.get("quantization_status", "compressed") != "compressed",
        "kv_cache_scheme": config.get("kv_cache_scheme") is not None,
        "transform_config": bool(config.get("transform_config")),
        "sparsity_config": bool(config.get("sparsity_config")),
    }
    for key, bad in wrong.items():
        if bad:
            raise ValueError(
                f"{where} has {key} {config.get(key)!r}, which Taktiny does not read: it reads "
                f"weight-only, symmetric int4 and int8 weights in the {FORMAT!r} format, "
                f"compressed, without transforms, sparsity or a quantized KV cache."
            )
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{where} has no config_groups: nothing says how it is quantized.")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        problems = {
            "format": group.get("format") not in (None, FORMAT),
            "input_activations": group.get("input_activations") is not None,
            "output_activations": group.get("output_activations") is not None,
            "weights.type": weights.get("type", "int") != "int",
            "weights.symmetric": weights.get("symmetric", True) is not True,
            "weights.num_bits": weights.get("num_bits") not in INT_DTYPES,
            "weights.strategy": weights.get("strategy") not in ("channel", "group"),
            "weights.actorder": weights.get("actorder") not in (None, "static"),
            "weights.dynamic": weights.get("dynamic", False) is not False,
        }
        for key, bad in problems.items():
            if bad:
                got = group.get(key) if "." not in key else weights.get(key.split(".")[1])
                raise ValueError(
                    f"{where}'s config group {name!r} has {key} {got!r}, out of Taktiny's scope: "
                    f"it reads weight-only (no input or output activation quantization), "
                    f"symmetric (no zero points), integer weights of 4 or 8 bits, one scale per "
                    f"output channel or per group, packed ({FORMAT!r}). Dequantize it with "
                    f"compressed_tensors and load the float weights instead."
                )
        group_size = weights.get("group_size") if weights["strategy"] == "group" else None
        out.append(((int(weights["num_bits"]), group_size), list(group.get("targets") or [])))
    return out


def compressed_rules(
    rule: Rule,
    names: Sequence[str],
    source: Mapping[str, Any],
    groups: Sequence[tuple[Layout, list[str]]],
) -> list[Rule]:
    """`rule` (one source template ``<module>.weight``, a rename or a transpose) reading
    the module's three pack-quantized tensors into a QArray; `names` are the
    ``weight_packed`` names it matches in `source`, whose shapes pick the layout among
    the config `groups` ((bits, group_size) and targets); where a module's tensors fit
    several (one group as wide as the row is also one scale per channel), the one whose
    targets name the module. Per-channel modules whose ``weight_shape`` records other
    input features than the rule's others in rows of the same words (which the shapes
    a plan sees cannot tell apart) get a rule each, before it."""
    module = rule.sources[0].removesuffix("weight")
    layouts = list(dict.fromkeys(layout for layout, _ in groups))
    fitting: set[Layout] = set()
    for name in names:
        packed, scale = source[name], source[name.removesuffix("packed") + "scale"]
        fits = set()
        for bits, group_size in layouts:
            try:
                unpack_quantized(bits, group_size)._features(packed, scale)
            except ValueError:
                continue
            fits.add((bits, group_size))
        named = {layout for layout, targets in groups if _targets(targets, name)} & fits
        fitting |= named if len(fits) > 1 and len(named) == 1 else fits
    if len(fitting) != 1:
        shown = sorted(fitting, key=str) if fitting else layouts
        raise ValueError(
            f"the pack-quantized tensors {list(names)[:3]} of {rule!r} fit "
            f"{'none' if not fitting else 'more than one'} of the checkpoint's config groups "
            f"(bits, group_size) {list(shown)}; a rule's modules must share one."
        )
    ((bits, group_size),) = fitting
    sources = [module + part for part in PARTS]
    if not isinstance(rule.transform, identity | transpose):
        raise ValueError(
            f"quantized_rules: {rule!r} reads pack-quantized weights ({names[0]!r}) with the "
            f"transform {rule.transform!r}; their integers and scales are read as a rename or "
            f"a transpose only. Write such a rule for these modules."
        )
    if group_size is not None:
        return [Rule(sources, rule.targets, unpack_quantized(bits, group_size, rule.transform))]
    features, own = _row_features(names, source, bits)
    transform = unpack_quantized(bits, None, rule.transform, features=features)
    general = Rule(sources, rule.targets, transform)
    out = []
    for name, (words, n) in own.items():  # (each module's own names: no captures)
        captures = general.patterns[0].fullmatch("." + name)
        assert captures is not None  # (`names` are what `rule` matches)
        targets = general.target_names(captures.groupdict(""))
        prefix = name.removesuffix("weight_packed")
        padded = {words: n} if n != words * (32 // bits) else None
        transform = unpack_quantized(bits, None, rule.transform, features=padded)
        out.append(Rule([prefix + part for part in PARTS], targets, transform))
    return [*out, general]


def _targets(targets: Sequence[str], name: str) -> bool:
    """Whether a config group's `targets` name the module of `name` (its
    ``weight_packed``): by its name, or a ``re:`` pattern matching it (compressed-tensors'
    targets; those naming a torch class are not read)."""
    module = name.removesuffix(".weight_packed")
    return any(
        t == module or (t.startswith("re:") and re.match(t[3:], module) is not None)
        for t in targets
    )


def _row_features(
    names: Sequence[str], source: Mapping[str, Any], bits: int
) -> tuple[dict[int, int], dict[str, tuple[int, int]]]:
    """The input features of per-channel modules (`names`: their ``weight_packed``) as
    their ``weight_shape`` records them: ``features`` for their rule (by words, those of
    most modules with rows of that many), and the ``(words, features)`` of each module
    that records others, by name. A shape that is not a readable record (only a shape
    and dtype are given) or that disagrees with its tensors is left to the transform,
    which checks each one it reads."""
    per, found = 32 // bits, {}
    for name in names:
        packed = source[name]
        record = source.get(name.removesuffix("packed") + "shape")
        if record is None or isinstance(record, jax.ShapeDtypeStruct):
            continue
        try:
            recorded = np.asarray(host_array(record)).tolist()
        except (TypeError, ValueError):
            continue
        words = packed.shape[-1]
        if (
            isinstance(recorded, list)
            and recorded[:-1] == list(packed.shape[:-1])
            and isinstance(recorded[-1], int)
            and -(-recorded[-1] // per) == words
        ):
            found.setdefault(words, {}).setdefault(recorded[-1], []).append(name)
    features, own = {}, {}
    for words, widths in found.items():
        usual = max(widths, key=lambda n: len(widths[n]))  # (the first of equals)
        if usual != words * per:
            features[words] = usual
        own.update({m: (words, n) for n, ms in widths.items() if n != usual for m in ms})
    return features, own


def export_compressed_tensors(
    rules: Sequence[AnyRule], model: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Exports a model holding int8 or int4 :class:`~taktiny.QArray` s (symmetric, one
    scale per channel or per group: :func:`taktiny.quantize`) as a compressed-tensors
    checkpoint: each quantized parameter that `rules` export as a ``<module>.weight``
    becomes that module's ``weight_packed``, ``weight_scale`` and ``weight_shape``, bit
    for bit (the integers packed, the scales as they are); every other parameter is
    exported as :func:`export` exports it. With the ``quantization_config`` it returns in
    the model's ``config.json``, ``compressed_tensors`` (and so ``transformers``, vLLM,
    SGLang) decompresses each weight to exactly ``QArray.dequantize()``, and
    :func:`quantized_rules` loads it back bit for bit: each module's config group is its
    QArray's layout (one group as wide as the row stays a group), and its
    ``weight_shape`` the input features its packed rows hold (of any number).

    Args:
        rules: the rules that load the float model from the torch names (their inverses
            export); each quantized parameter's rule a rename or a transpose that puts
            the quantized axis last (a ``Linear``'s input features).
        model: the quantized model.

    Returns:
        ``(tensors, quantization_config)``: the flat ``{name: array}`` to save with
        :func:`~taktiny.io.save_safetensors`, and the dict to put under
        ``"quantization_config"`` in ``config.json`` (one config group per layout, each
        naming its modules).

    Raises:
        ValueError: a quantized parameter whose rule is not a rename or a transpose,
            that does not export as a ``<module>.weight``, or whose quantized axis does
            not end last.
        TypeError: an abstract model, which has no values to write.
        taktiny.convert.ConversionError: as :func:`export`.
    """
    from ._convert import _leaves, export

    is_q = lambda x: isinstance(x, Parameter)
    part = lambda which: jax.tree.map(
        lambda x: x.part_values()[which] if is_q(x) else x, model, is_leaf=is_q
    )
    values, scales = _leaves(part(0), rules), _leaves(part(1), rules)  # (a QArray's two)
    quantized = [n for n in values if np.dtype(values[n].dtype) != np.dtype(scales[n].dtype)]
    if any(isinstance(a, jax.ShapeDtypeStruct) for a in values.values()):
        raise TypeError(
            "export_compressed_tensors: the model is abstract (jax.eval_shape): it has no "
            "values to write. Load or build the model first."
        )
    # each QArray's group size (0: per channel), shaped as its scales so that export names
    # and lays it out as them: one group spanning the axis is not per channel to Taktiny
    sizes = jax.tree.map(
        lambda x: (
            jnp.full(x.part_values()[1].shape, x.layout()["group_size"] or 0, jnp.int32)
            if is_q(x)
            else x
        ),
        model,
        is_leaf=is_q,
    )
    sizes = _leaves(sizes, rules)
    skip = set(quantized)
    tensors = dict(export(rules, {n: a for n, a in values.items() if n not in skip}))
    ints = export(rules, {n: values[n] for n in quantized})
    factors = export(rules, {n: scales[n] for n in quantized})
    group_sizes = export(rules, {n: sizes[n] for n in quantized})
    groups: dict[tuple[int, int | None], list[str]] = {}
    for name, value in ints.items():
        value, scale = host_array(value), host_array(factors[name])
        bits = 4 if np.dtype(value.dtype) == np.dtype(jnp.int4) else 8
        *lead, n = value.shape
        groups_n = scale.shape[-1] if scale.ndim == value.ndim else 0
        group_size = int(host_array(group_sizes[name]).flat[0]) or None
        if (
            not name.endswith(".weight")
            or value.ndim != 2
            or tuple(scale.shape[:-1]) != tuple(lead)
            or not groups_n
            or groups_n * (group_size or n) != n
        ):
            raise ValueError(
                f"export_compressed_tensors: the quantized parameter exported as {name!r} "
                f"({value.dtype.name}{list(value.shape)}, scales {list(scale.shape)}) is not a "
                f"module's weight [out, in] quantized along its input features: "
                f"compressed-tensors holds such weights only. Keep that layer in float "
                f"(tt.quantize(..., where=...)), or export its rule as a transpose to [out, in]."
            )
        module = name.removesuffix("weight")
        tensors[module + "weight_packed"] = pack_int32(value, bits)
        tensors[module + "weight_scale"] = scale
        tensors[module + "weight_shape"] = np.asarray(value.shape, np.int64)
        groups.setdefault((bits, group_size), []).append(module.removesuffix("."))
    return tensors, quantization_config(groups)


def quantization_config(groups: Mapping[tuple[int, int | None], list[str]]) -> dict[str, Any]:
    """The ``quantization_config`` of a pack-quantized checkpoint whose modules are
    grouped by (bits, group_size)."""
    config_groups = {
        f"group_{i}": {
            "targets": sorted(modules),
            "weights": {
                "num_bits": bits,
                "type": "int",
                "symmetric": True,
                "strategy": "channel" if group_size is None else "group",
                "group_size": group_size,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
                "observer_kwargs": {},
            },
            "input_activations": None,
            "output_activations": None,
            "format": FORMAT,
        }
        for i, ((bits, group_size), modules) in enumerate(sorted(groups.items(), key=str))
    }
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": [],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }
