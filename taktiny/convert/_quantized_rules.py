"""`quantized_rules`: the rules of a float model, made to read a checkpoint quantized in
another library's format (FP8 block-scaled weights, compressed-tensors' packed integers),
as its ``config.json`` describes it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._compressed_tensors import FORMAT, compressed_rules, scheme
from ._fp8 import SCALE_SUFFIX, fp8_rule
from ._rules import AnyRule, FirstMatch, Rule, compile_template

METHODS = ("fp8", "compressed-tensors")  # the quant_method values read


def quantized_rules(
    rules: Sequence[AnyRule],
    checkpoint: Mapping[str, Any],
    *,
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
) -> list[AnyRule]:
    """The rules that load a float model from a checkpoint quantized in one of the
    formats models are shipped in, made from the rules that load it from the float
    checkpoint. The ``quantization_config`` of the checkpoint's ``config.json`` says which:

    - ``"quant_method": "fp8"`` with ``"weight_block_size": [128, 128]``: each
      ``<module>.weight`` that has a ``<module>.weight_scale_inv`` is read with it and
      dequantized block by block (:class:`dequantize_blocks`) before the rule's own
      transform: into a float model, or quantized again on the stream into a
      :func:`taktiny.quantize` d one, tensor by tensor.
    - ``"quant_method": "compressed-tensors"``, ``pack-quantized``, symmetric int4 or int8
      weights per channel or per group: each module's ``weight_packed``,
      ``weight_scale`` and ``weight_shape`` are read into a :class:`~taktiny.QArray`
      (:class:`unpack_quantized`), which loads bit for bit into a quantized model of the
      same layout and dequantized into a float one. The layout is the config group
      whose shapes the tensors fit (the one whose ``targets`` name the module, where
      they fit several); a per-channel module's input features are what its
      ``weight_shape`` records (read here, a few bytes each: its packed rows have room
      for up to ``32 // bits - 1`` more), and a module that records other features than
      the rule's others with rows of as many words gets a rule of its own.

    A rule is rewritten when it reads one ``<module>.weight`` template (as the presets'
    do: :func:`linear`, a rename or a transpose). An FP8 rule's modules must all be
    quantized, or all not; a compressed-tensors rule that also reads modules left in
    float (the config's ``ignore``, such as ``lm_head``) is kept for them, after the
    rewritten one. Names left over (scales no rule reads) are the load's usual problems.

    Args:
        rules: the rules for the model's float checkpoint.
        checkpoint: the opened checkpoint (:func:`~taktiny.io.open_safetensors`), or any
            mapping of its names to arrays (or to anything with ``shape`` and ``dtype``).
        config: the checkpoint's ``config.json``: its path, its dict, or the
            ``quantization_config`` dict alone; None (the default) reads the
            ``config.json`` beside a local checkpoint.

    Returns:
        The rules, each quantized module's rule rewritten, the others as they were.

    Raises:
        ValueError: no ``config.json`` (or no ``quantization_config`` in it); a
            ``quant_method``, format or scheme Taktiny does not read (asymmetric zero
            points, activation quantization, other formats), naming it; a rule whose
            modules are quantized in part, that reads a quantized weight other than as
            one ``<module>.weight`` template, or whose modules fit different config
            groups.
    """
    quantization = _quantization_config(checkpoint, config)
    method = quantization.get("quant_method")
    names = list(checkpoint)
    taken = _taken(rules, names)
    out: list[AnyRule] = []
    if method == "fp8":
        block_size = _block_size(quantization)
        for i, rule in enumerate(rules):
            matched = taken.get(i, [])
            scaled = [n for n in matched if n + SCALE_SUFFIX in checkpoint]
            if scaled:
                assert isinstance(rule, Rule)  # (only a Rule takes names)
                _one_weight(rule, "FP8 block-scaled weights", scaled)
                if len(scaled) != len(matched):
                    unscaled = sorted(set(matched) - set(scaled))
                    raise ValueError(
                        f"quantized_rules: {rule!r} reads FP8 weights with block scales "
                        f"({scaled[0]!r}) and weights without ({unscaled[0]!r}); split it "
                        f"into a rule for each."
                    )
                out.append(fp8_rule(rule, block_size))
            else:
                out.append(rule)
        return out
    if method == "compressed-tensors":
        groups = scheme(quantization)
        for i, rule in enumerate(rules):
            packed = _packed(rule, names)
            if packed:
                assert isinstance(rule, Rule)  # (only a Rule takes names)
                _one_weight(rule, f"compressed-tensors {FORMAT!r} weights", packed)
                out.extend(compressed_rules(rule, packed, checkpoint, groups))
                if i not in taken:
                    continue
            out.append(rule)
        return out
    raise ValueError(
        f"quantized_rules: the checkpoint's quantization_config has quant_method "
        f"{method!r}; Taktiny reads {list(METHODS)} (FP8 block-scaled weights, and "
        f"compressed-tensors int4/int8). Dequantize it with its own library and load the "
        f"float weights."
    )


def _quantization_config(
    checkpoint: Mapping[str, Any], config: Mapping[str, Any] | str | os.PathLike[str] | None
) -> Mapping[str, Any]:
    where = "quantized_rules"
    if config is None:
        path = getattr(checkpoint, "path", None)
        if not isinstance(path, Path):
            raise ValueError(
                f"{where}: pass config=, the checkpoint's config.json (its path or dict): "
                f"only a local checkpoint's is found beside it."
            )
        config = (path if path.is_dir() else path.parent) / "config.json"
    if isinstance(config, str | os.PathLike):
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, ValueError) as error:
            raise ValueError(
                f"{where}: cannot read the checkpoint's config {str(config)!r} ({error}); pass "
                f"config=, its config.json (a path or a dict)."
            ) from None
    if not isinstance(config, Mapping):
        raise ValueError(f"{where}: config is a config.json's dict or path, got {config!r}.")
    quantization = config.get("quantization_config", config)
    if not isinstance(quantization, Mapping) or "quant_method" not in quantization:
        raise ValueError(
            f"{where}: the config has no quantization_config (with a quant_method): the "
            f"checkpoint is not quantized, and loads with its rules as they are."
        )
    return quantization


def _block_size(quantization: Mapping[str, Any]) -> tuple[int, ...]:
    block = quantization.get("weight_block_size")
    fmt, activations = quantization.get("fmt", "e4m3"), quantization.get("activation_scheme")
    if not (
        isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
    ):
        raise ValueError(
            f"quantized_rules: an FP8 checkpoint's weight_block_size is two positive ints "
            f"([128, 128]), got {block!r}; Taktiny reads block-scaled FP8 only (per-tensor "
            f"FP8 scales are out of its scope)."
        )
    if fmt != "e4m3" or activations not in (None, "dynamic"):
        raise ValueError(
            f"quantized_rules: this FP8 checkpoint has fmt {fmt!r} and activation_scheme "
            f"{activations!r}; Taktiny reads e4m3 weights with dynamic (unstored) activation "
            f"scales only."
        )
    return tuple(block)


def _taken(rules: Sequence[AnyRule], names: Sequence[str]) -> dict[int, list[str]]:
    """The names each Rule takes (it is the first to match them), by its index."""
    taken: dict[int, list[str]] = {}
    first_match = FirstMatch(rules)
    for name in names:
        found = first_match(name)
        if found is not None and isinstance(rules[found[0]], Rule):
            taken.setdefault(found[0], []).append(name)
    return taken


def _packed(rule: AnyRule, names: Sequence[str]) -> list[str]:
    """The ``weight_packed`` names of the modules whose ``weight`` `rule` reads."""
    if not isinstance(rule, Rule) or rule.regex or len(rule.sources) != 1:
        return []
    source = rule.sources[0]
    if not source.endswith("weight") or source.split(".")[-1] != "weight":
        return []
    pattern = compile_template(source + "_packed", repr(rule), deep=rule.deep)
    return [n for n in names if pattern.fullmatch("." + n)]


def _one_weight(rule: Rule, what: str, names: Sequence[str]) -> None:
    """Refuses a rule that reads quantized weights other than as one template
    ``<module>.weight`` (a rename or a transpose for compressed-tensors)."""
    source = rule.sources[0]
    if (
        rule.regex
        or len(rule.sources) != 1
        or rule.gathered is not None
        or source.split(".")[-1] != "weight"
    ):
        raise ValueError(
            f"quantized_rules: {rule!r} reads {what} ({names[0]!r}), and only a rule that "
            f"reads one '<module>.weight' template (no regex, no gathering) can read them "
            f"with their scales; write such a rule for these modules before it."
        )
