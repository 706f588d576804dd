"""Presets: the rules for PyTorch's layer conventions, one function per layer family, and
`pytorch(model)`, which emits them for every layer of a model that mirrors a torch module.

Each preset maps the parameters under a source prefix (``"encoder.layer.{i}.query"``) to
those under a target prefix (``"layers.{i}.attention.query"``); prefixes are name
templates, so ``{captures}`` carry over. An empty prefix means the layer is the root.
Everything here is a plain list of :class:`Rule` and :class:`Ignore`: nothing that
``convert`` treats specially.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import nn
from ..state import fields as names_fields
from ._rules import AnyRule, Ignore, Rule
from ._transforms import Transform, chain, concatenate, flip, split, transpose

_QKV = ("query", "key", "value")


def _at(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _pair(source: str, target: str, names: Sequence[tuple[str, str]]) -> list[AnyRule]:
    return [Rule(_at(source, s), _at(target, t)) for s, t in names]


def _bias(source: str, target: str, bias: bool) -> list[AnyRule]:
    return _pair(source, target, [("bias", "bias")] if bias else [])


def linear(source: str, target: str, *, bias: bool = True) -> list[AnyRule]:
    """``nn.Linear``: ``weight`` ``[out, in]`` -> :class:`~taktiny.nn.Linear`'s ``kernel``
    ``[in, out]`` (transposed); ``bias`` ``[out]`` as it is.

    Args:
        source: the torch layer's prefix, a name template (``""`` for the root).
        target: the Taktiny layer's prefix, a name template (``""`` for the root).
        bias: whether the layer has a bias.

    Returns:
        The rules, to pass to :func:`convert` and :func:`export` (alone or with others).
    """
    weight = Rule(_at(source, "weight"), _at(target, "kernel"), transpose())
    return [weight, *_bias(source, target, bias)]


def _window(dims: int) -> tuple[int, ...]:
    if not isinstance(dims, int) or not 1 <= dims <= 22:  # Conv's limit
        raise ValueError(f"dims is the number of spatial axes of the kernel, got {dims!r}.")
    return tuple(range(2, 2 + dims))


def conv(source: str, target: str, *, dims: int, bias: bool = True) -> list[AnyRule]:
    """``nn.Conv{dims}d``: ``weight`` ``[out, in // groups, *window]`` ->
    :class:`~taktiny.nn.Conv`'s ``kernel`` ``[*window, in // groups, out]`` (the first two
    axes moved last, swapped; any ``groups``); ``bias`` ``[out]`` as it is.

    Args:
        source: the torch layer's prefix, a name template (``""`` for the root).
        target: the Taktiny layer's prefix, a name template (``""`` for the root).
        dims: the number of spatial axes (1, 2 or 3).
        bias: whether the layer has a bias.

    Returns:
        The rules, to pass to :func:`convert` and :func:`export` (alone or with others).

    Raises:
        ValueError: `dims` is not an int from 1 to 22.
    """
    perm = (*_window(dims), 1, 0)
    weight = Rule(_at(source, "weight"), _at(target, "kernel"), transpose(perm))
    return [weight, *_bias(source, target, bias)]


def conv_transpose(
    source: str,
    target: str,
    *,
    dims: int,
    groups: int = 1,
    in_features: int | None = None,
    out_features: int | None = None,
    bias: bool = True,
) -> list[AnyRule]:
    """``nn.ConvTranspose{dims}d``: ``weight`` ``[in, out // groups, *window]`` ->
    :class:`~taktiny.nn.ConvTranspose`'s ``kernel`` ``[*window, in // groups, out]``,
    the window mirrored (Taktiny stores the kernel of the equivalent convolution);
    ``bias`` ``[out]`` as it is. With ``groups > 1`` the groups move from the input axis
    to the output axis.

    Args:
        source: the torch layer's prefix, a name template (``""`` for the root).
        target: the Taktiny layer's prefix, a name template (``""`` for the root).
        dims: the number of spatial axes (1, 2 or 3).
        groups: PyTorch's ``groups``.
        in_features: the input channels; needed with ``groups > 1``.
        out_features: the output channels; needed with ``groups > 1``.
        bias: whether the layer has a bias.

    Returns:
        The rules, to pass to :func:`convert` and :func:`export` (alone or with others).

    Raises:
        ValueError: `dims` is not an int from 1 to 22, or ``groups > 1`` without
            `in_features` and `out_features`.
    """
    window = _window(dims)
    steps: list[Transform] = [transpose((*window, 0, 1)), flip(range(dims))]
    if groups != 1:
        if in_features is None or out_features is None:
            raise ValueError(
                f"conv_transpose({source!r}, {target!r}) with groups={groups} needs "
                f"in_features and out_features to regroup the kernel; pass them."
            )
        inner, outer = [in_features // groups] * groups, [out_features // groups] * groups
        steps[:0] = [split(0, inner), concatenate(1, outer)]  # [in, o, *w] -> [i, out, *w]
    weight = Rule(_at(source, "weight"), _at(target, "kernel"), chain(*steps))
    return [weight, *_bias(source, target, bias)]


def layer_norm(source: str, target: str, *, scale: bool = True, bias: bool = True) -> list[AnyRule]:
    """``nn.LayerNorm`` (and ``nn.RMSNorm`` with ``bias=False``): ``weight`` ``[features]``
    -> ``scale``; ``bias`` ``[features]`` as it is.

    Args:
        source: the torch layer's prefix, a name template (``""`` for the root).
        target: the Taktiny layer's prefix, a name template (``""`` for the root).
        scale: whether the layer has a scale (torch's ``weight``).
        bias: whether the layer has a bias.

    Returns:
        The rules, to pass to :func:`convert` and :func:`export` (alone or with others).
    """
    names = [("weight", "scale")] if scale else []
    return _pair(source, target, names) + _bias(source, target, bias)


def group_norm(source: str, target: str, *, scale: bool = True, bias: bool = True) -> list[AnyRule]:
    """``nn.GroupNorm``: ``weight`` ``[features]`` -> :class:`~taktiny.nn.GroupNorm`'s
    ``scale``; ``bias`` ``[features]`` as it is (``affine=False``: neither). The rules
    are :func:`layer_norm`'s.

    Args:
        source: as for :func:`layer_norm`.
        target: as for :func:`layer_norm`.
        scale: whether the layer has a scale (torch's ``affine``).
        bias: whether the layer has a bias (torch's ``affine``).

    Returns:
        :func:`layer_norm`'s rules.
    """
    return layer_norm(source, target, scale=scale, bias=bias)


def embedding(source: str, target: str) -> list[AnyRule]:
    """``nn.Embedding``: ``weight`` ``[num_embeddings, features]`` ->
    :class:`~taktiny.nn.Embed`'s ``embedding``, the same layout.

    Args:
        source: the torch layer's prefix, a name template (``""`` for the root).
        target: the Taktiny layer's prefix, a name template (``""`` for the root).

    Returns:
        The rules, to pass to :func:`convert` and :func:`export` (alone or with others).
    """
    return _pair(source, target, [("weight", "embedding")])


def batch_norm(source: str, target: str) -> list[AnyRule]:
    """``nn.BatchNorm{1,2,3}d``: ``weight``, ``bias``, ``running_mean``, ``running_var``
    (each ``[features]``) -> ``scale``, ``bias``, ``mean``, ``var``;
    ``num_batches_tracked`` (a step count) is ignored, and exported as 0 so that strict
    readers (``from_pretrained``) find it; torch reads it only for ``momentum=None``.

    Args:
        source: the torch layer's prefix, a name template (``""`` for the root).
        target: the Taktiny layer's prefix, a name template (``""`` for the root).

    Returns:
        The rules, to pass to :func:`convert` and :func:`export` (alone or with others).
    """
    names = [
        ("weight", "scale"),
        ("bias", "bias"),
        ("running_mean", "mean"),
        ("running_var", "var"),
    ]
    count = Ignore(_at(source, "num_batches_tracked"), export=np.zeros((), np.int64))
    return [*_pair(source, target, names), count]


def multihead_attention(
    source: str, target: str, *, fused: bool = True, bias: bool = True
) -> list[AnyRule]:
    """``nn.MultiheadAttention``: ``in_proj_weight`` ``[3 * E, E]`` split in three and
    transposed -> ``query``/``key``/``value`` ``kernel`` ``[E, E]`` (``fused=False``, when
    ``kdim`` differs: ``q_proj_weight`` ``[E, E]``, ``k_proj_weight`` and ``v_proj_weight``
    ``[E, kdim]``, each transposed); ``in_proj_bias`` ``[3 * E]`` split in three ->
    their ``bias``; ``out_proj`` as :func:`linear` -> ``out``.

    Args:
        source: the torch layer's prefix, a name template (``""`` for the root).
        target: the Taktiny layer's prefix, a name template (``""`` for the root).
        fused: whether torch holds the three input projections in one
            ``in_proj_weight`` (its ``kdim`` and ``vdim`` equal to ``embed_dim``).
        bias: whether the layer has biases.

    Returns:
        The rules, to pass to :func:`convert` and :func:`export` (alone or with others).
    """

    def each(name: str) -> list[str]:
        return [_at(target, f"{p}.{name}") for p in _QKV]

    if fused:
        kernels = each("kernel")
        rules: list[AnyRule] = [
            Rule(_at(source, "in_proj_weight"), kernels, chain(split(0), transpose()))
        ]
    else:
        rules = [
            Rule(_at(source, f"{p[0]}_proj_weight"), k, transpose())
            for p, k in zip(_QKV, each("kernel"), strict=True)
        ]
    if bias:
        rules.append(Rule(_at(source, "in_proj_bias"), each("bias"), split(0)))
    return rules + linear(_at(source, "out_proj"), _at(target, "out"), bias=bias)


# Buffers that Hugging Face and PyTorch checkpoints carry beside the weights, by the names
# transformers gives them: position and token-type id ranges (BERT and its kin), rotary
# frequencies (Llama), GPT-2's causal masks and BatchNorm's step count. A model computes
# them; none is a parameter.
_BUFFERS = (
    "**.position_ids",
    "**.token_type_ids",
    "**.inv_freq",
    "**.attn.bias",
    "**.attn.masked_bias",
    "**.num_batches_tracked",
)


def buffers() -> list[AnyRule]:
    """An :class:`Ignore` of the buffers checkpoints commonly hold beside the weights:
    ``position_ids`` and ``token_type_ids`` (BERT and its kin), rotary ``inv_freq``
    (Llama), GPT-2's causal masks ``attn.bias`` and ``attn.masked_bias``, and BatchNorm's
    ``num_batches_tracked``, under any prefix. Put it after the model's own rules: a name
    an earlier rule takes is that rule's. What it drops is listed in the
    :class:`Report`'s ``ignored``; a checkpoint without them is fine. :func:`pytorch`
    ends with it.

    Returns:
        A list of one :class:`Ignore`.
    """
    return [Ignore(*_BUFFERS)]


def _layer(layer: Any, source: str, target: str) -> list[AnyRule] | None:
    """The preset for one Taktiny layer, or None when it is not a layer with a preset."""
    has_bias = getattr(layer, "bias", None) is not None
    if isinstance(layer, nn.Linear):
        return linear(source, target, bias=has_bias)
    if isinstance(layer, (nn.Conv, nn.ConvTranspose)):
        *window, per_group, out = layer.kernel.shape
        if isinstance(layer, nn.Conv):
            return conv(source, target, dims=len(window), bias=has_bias)
        groups = layer.feature_group_count
        return conv_transpose(
            source,
            target,
            dims=len(window),
            groups=groups,
            in_features=per_group * groups,
            out_features=out,
            bias=has_bias,
        )
    if isinstance(layer, nn.LayerNorm):
        return layer_norm(source, target, scale=layer.scale is not None, bias=has_bias)
    if isinstance(layer, nn.GroupNorm):
        return group_norm(source, target, scale=layer.scale is not None, bias=has_bias)
    if isinstance(layer, nn.RMSNorm):
        return layer_norm(source, target, bias=False)
    if isinstance(layer, nn.Embed):
        return embedding(source, target)
    if isinstance(layer, nn.BatchNorm):
        return batch_norm(source, target)
    if isinstance(layer, nn.MultiHeadAttention):
        fused = layer.key.kernel.shape[0] == layer.query.kernel.shape[0]
        return multihead_attention(source, target, fused=fused, bias=layer.out.bias is not None)
    return None


def pytorch(model: Any, source: str = "", target: str = "") -> list[AnyRule]:
    """The rules that convert the state dict of a torch module whose structure mirrors
    `model` (the same attribute names, lists as ``nn.ModuleList``, dicts as
    ``nn.ModuleDict``): the layer preset of every :class:`~taktiny.nn.Linear`, ``Conv``,
    ``ConvTranspose``, ``LayerNorm``, ``GroupNorm``, ``RMSNorm``, ``Embed``, ``BatchNorm``
    and ``MultiHeadAttention`` in `model`, at its name. A :class:`~taktiny.nn.Sequential`
    is ``nn.Sequential``: its ``layers.0``, ``layers.1``, ... are torch's ``0``, ``1``,
    ... (a function among the layers takes a position, as ``nn.ReLU()`` does).

    Arrays set directly on modules of your own get no rule: coverage reports them, and
    you add their rules to the list. The list ends with :func:`buffers`, which drops the
    buffers checkpoints carry (``position_ids``, ``inv_freq``, ...).

    Args:
        model: the Taktiny model (or part of one) the torch module mirrors; it may be
            abstract (``tt.eval_shape``).
        source: the prefix of the torch names (``pytorch(model.encoder, "bert.encoder",
            "encoder")``); ``""`` for none.
        target: the prefix of the Taktiny names; ``""`` for none.

    Returns:
        The rules, to use with :func:`convert` and :func:`export`.
    """
    rules: list[AnyRule] = []
    _walk(model, source, target, rules)
    return [*rules, *buffers()]


def _walk(node: Any, source: str, target: str, rules: list[AnyRule]) -> None:
    preset = _layer(node, source, target)
    if preset is not None:
        rules.extend(preset)
    elif isinstance(node, nn.Sequential):
        for i, layer in enumerate(node.layers):
            _walk(layer, _at(source, str(i)), _at(target, f"layers.{i}"), rules)
    elif (fields := names_fields(node)) is not None:
        for name, value in fields.items():
            _walk(value, _at(source, name), _at(target, name), rules)
    elif isinstance(node, (list, tuple, dict)):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            _walk(value, _at(source, str(key)), _at(target, str(key)), rules)
