"""Low-rank adapters (LoRA): `LoRALinear` and `LoRAEmbed`, which add ``scale * A @ B`` to a
frozen base weight, and `lora` / `merge_lora`, which put them into a whole model and take
them out again.

An adapted layer keeps its base's fields under the same names (``kernel`` and ``bias``, or
``embedding``), declared ``trainable=False``, and adds ``lora_a`` and ``lora_b`` beside
them: the flat state of ``attention.query`` becomes ``attention.query.kernel``,
``attention.query.lora_a`` and ``attention.query.lora_b``. So a base checkpoint loads onto
an adapted model unchanged, the adapters alone are the leaves whose names hold
``".lora_"``, and :func:`taktiny.trainable` (hence optax's mask) picks the adapters only.
The base weight may be a float array or a :class:`~taktiny.QArray` (QLoRA); the layer
computes exactly what its base layer computes and adds the low-rank term, so at
initialisation (``lora_b`` zeros) its output equals the base's bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Literal, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Integer

from .._qarray import QArray, quantize_like
from ..module._module import Module, field, fields_of
from ..module._rngs import Rngs
from ..state._names import flatten, key_name
from ..state._patterns import compile_pattern, unused_hint
from ._embed import Embed
from ._explicit import project
from ._linear import Linear
from ._quantized import QuantizedEmbed, QuantizedLinear, build

# Adapters are stored in float32 whatever the base's dtype, as PEFT keeps them: a small
# update to a bfloat16 adapter would otherwise be lost to rounding.
_ADAPTER_DTYPE = jnp.float32


def _scale(rank: Any, alpha: Any, where: str) -> float:
    """``alpha / rank`` (1 when `alpha` is None), the rank checked."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: rank is a positive int (8, 16), got {rank!r}.")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))):
        raise TypeError(f"{where}: alpha is a number (16) or None (alpha = rank), got {alpha!r}.")
    return 1.0 if alpha is None else float(alpha) / rank


def _adapter(draw: Callable[[], jax.Array], shape: tuple[int, int], weight: Any, axis: int) -> Any:
    """An adapter factor of `shape`, drawn by `draw`, placed as the base `weight` (an array,
    a QArray or a ``jax.ShapeDtypeStruct``) is on its `axis` (0: the factor's first axis
    follows the weight's first; 1: its second follows the weight's second), the rank axis
    unsplit. An abstract `weight` gives an abstract factor and draws nothing."""
    base = weight.value if isinstance(weight, QArray) else weight
    sharding = getattr(base, "sharding", None)
    placed = None
    if isinstance(sharding, NamedSharding):
        entries = (*sharding.spec, None, None)[:2]
        spec = P(entries[0], None) if axis == 0 else P(None, entries[1])
        placed = NamedSharding(sharding.mesh, spec)
    if isinstance(base, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, _ADAPTER_DTYPE, sharding=placed)
    array = draw()
    return array if placed is None else jax.device_put(array, placed)


class _Adapter(Module):
    """What the adapted layers share: the two factors (listed for :func:`taktiny.trainable`
    in ``_taktiny_adapters``), their scale, and the base's dtype and precision."""

    _taktiny_adapters: ClassVar[tuple[str, ...]] = ("lora_a", "lora_b")
    lora_a: Float[Array, "rows rank"]
    lora_b: Float[Array, "rank columns"]
    scale: float
    dtype: jnp.dtype | None = field(static=True)  # (no default: the layers' fields follow)
    precision: jax.lax.PrecisionLike = field(static=True)

    def _adapt(self, base: Any, weight: Any, rank: int, draw: Any, rngs: Rngs) -> None:
        """Sets ``lora_a`` (``draw(key, shape)``) and ``lora_b`` (zeros) for the base
        `weight` ``[rows, columns]``, placed as it is, then the base's dtype and
        precision."""
        rows, columns = weight.shape
        key = rngs()
        self.lora_a = _adapter(lambda: draw(key, (rows, rank)), (rows, rank), weight, axis=0)
        zeros = lambda: jnp.zeros((rank, columns), _ADAPTER_DTYPE)
        self.lora_b = _adapter(zeros, (rank, columns), weight, axis=1)
        self.dtype, self.precision = base.dtype, base.precision


class LoRALinear(_Adapter):
    """A :class:`Linear` or :class:`QuantizedLinear` with a low-rank adapter:
    ``y = x @ kernel + bias + scale * (x @ lora_a) @ lora_b``.

    The base layer computes its output as it would alone (dequantizing a quantized
    kernel), and the adapter's term is added to it, computed from the activations
    through the rank: two skinny products, ``[*batch, in] @ [in, rank]`` then
    ``[*batch, rank] @ [rank, out]``, in the dtype the base computes in, at its
    precision. The adapted kernel ``kernel + scale * lora_a @ lora_b`` is never formed,
    and nothing ``[in, out]``-sized is computed for the frozen kernel in the backward
    pass: its gradient is not needed, and the factors' gradients come from the
    activations, as the input's does. A training step then costs the base's forward
    and the input's gradient, plus the skinny products (``bench/lora.py``): less than
    full fine-tuning, which also forms each kernel's gradient and its optimiser update.
    At initialisation ``lora_b`` is zeros, so the added term is zero and the output is
    the base's exactly.

    The base's parameters are kept under their own names and declared
    ``trainable=False``: no gradient flows into them. :func:`taktiny.trainable` of a tree
    holding adapters marks only ``lora_a`` and ``lora_b`` ``True`` (every other
    parameter of the model too is frozen), so an optimiser masked by it trains the
    adapters only.

    Attributes:
        kernel: the base's kernel, ``[in_features, out_features]``: a float array, or a
            :class:`~taktiny.QArray` (QLoRA). Not trained.
        bias: the base's bias ``[out_features]``, or ``None``. Not trained.
        lora_a: ``[in_features, rank]``, float32, drawn as PEFT draws its ``lora_A``
            (Kaiming-uniform with ``a = sqrt(5)``, which is uniform on
            ``±1 / sqrt(in_features)``), split as the kernel's input axis.
        lora_b: ``[rank, out_features]``, float32, zeros (so the layer starts as its base),
            split as the kernel's output axis.
        scale: ``alpha / rank``, static.
        dtype: the base's ``dtype`` (the dtype it computes in; None: as the base does).
        precision: the base's ``precision``, also that of the adapter's products.

    Args:
        base: the layer to adapt, a :class:`Linear` or :class:`QuantizedLinear` (an
            abstract one from ``jax.eval_shape`` gives abstract adapters).
        rank: the adapter's rank.
        alpha: the scale's numerator; None for ``alpha = rank`` (scale 1).
        rngs: the key stream that draws ``lora_a``.

    Raises:
        TypeError: `base` is not a ``Linear`` or ``QuantizedLinear``, or `alpha` is not a
            number.
        ValueError: `rank` is not a positive int.
    """

    kernel: Float[Array, "in_features out_features"] | QArray = field(trainable=False)
    bias: Float[Array, " out_features"] | None = field(trainable=False)

    def __init__(self, base: Any, rank: int, *, alpha: float | int | None = None, rngs: Rngs):
        if not isinstance(base, Module) or type(base)._taktiny_base not in _LINEARS:
            raise TypeError(f"LoRALinear adapts a Linear or QuantizedLinear, got {base!r:.80}.")
        self.scale = _scale(rank, alpha, "LoRALinear")
        self.kernel, self.bias = base.kernel, base.bias
        bound = 1.0 / math.sqrt(base.kernel.shape[0])
        draw = lambda key, shape: jax.random.uniform(key, shape, _ADAPTER_DTYPE, -bound, bound)
        self._adapt(base, base.kernel, rank, draw, rngs)

    def __call__(
        self, x: Float[Array, "*batch in_features"]
    ) -> Float[Array, "*batch out_features"]:
        """Applies the adapted kernel to the last axis of `x`, as the base layer would.

        Args:
            x: ``[*batch, in_features]``.

        Returns:
            ``[*batch, out_features]``, in the dtype the base layer returns.

        Raises:
            ValueError: the last axis of `x` does not have ``in_features`` entries.
        """
        with jax.named_scope("LoRALinear"):
            y = _base(self)(x)
            down = project(x.astype(y.dtype), self.lora_a.astype(y.dtype), None, self.precision)
            up = project(self.scale * down, self.lora_b.astype(y.dtype), None, self.precision)
            return y + up


class LoRAEmbed(_Adapter):
    """An :class:`Embed` or :class:`QuantizedEmbed` with a low-rank adapter: the table is
    ``embedding + scale * lora_a @ lora_b``, for lookups and for :meth:`attend` alike.

    That table is never formed: a lookup adds ``scale * lora_a[ids] @ lora_b`` to the
    base's rows, :meth:`attend` adds ``scale * (x @ lora_b.T) @ lora_a.T`` to the base's
    scores, so training computes no ``[num_embeddings, features]`` gradient.

    Attributes:
        embedding: the base's table, ``[num_embeddings, features]``, a float array or a
            :class:`~taktiny.QArray`. Not trained.
        lora_a: ``[num_embeddings, rank]``, float32, standard normal (as the embedding's
            own initialisation), split as the table's vocabulary axis. PEFT draws the
            other factor instead (its ``lora_embedding_A`` zeros, ``lora_embedding_B``
            normal); keeping ``lora_b`` the zero one here gives every adapter one rule.
        lora_b: ``[rank, features]``, float32, zeros, split as the table's feature axis.
        scale: ``alpha / rank``, static.
        dtype: the base's ``dtype`` (the dtype it computes in; None: as the base does).
        precision: the base's ``precision``, also that of the adapter's products.

    Args:
        base: the layer to adapt, an :class:`Embed` or :class:`QuantizedEmbed`.
        rank: the adapter's rank.
        alpha: the scale's numerator; None for ``alpha = rank`` (scale 1).
        rngs: the key stream that draws ``lora_a``.

    Raises:
        TypeError: `base` is not an ``Embed`` or ``QuantizedEmbed``, or `alpha` is not a
            number.
        ValueError: `rank` is not a positive int.
    """

    embedding: Float[Array, "num_embeddings features"] | QArray = field(trainable=False)

    def __init__(self, base: Any, rank: int, *, alpha: float | int | None = None, rngs: Rngs):
        if not isinstance(base, Module) or type(base)._taktiny_base not in _EMBEDS:
            raise TypeError(f"LoRAEmbed adapts an Embed or QuantizedEmbed, got {base!r:.80}.")
        self.scale = _scale(rank, alpha, "LoRAEmbed")
        self.embedding = base.embedding
        draw = lambda key, shape: jax.random.normal(key, shape, _ADAPTER_DTYPE)
        self._adapt(base, base.embedding, rank, draw, rngs)

    def __call__(self, ids: Integer[Array, "*batch"]) -> Float[Array, "*batch features"]:
        """The base's rows for `ids` plus the adapter's, ``scale * lora_a[ids] @ lora_b``.

        Args:
            ids: ``[*batch]``, integers (indexed as :class:`Embed` indexes them).

        Returns:
            ``[*batch, features]``, in the dtype the base layer returns.

        Raises:
            TypeError: `ids` is not an integer array.
        """
        with jax.named_scope("LoRAEmbed"):
            rows = _base(self)(ids)
            config = {"dtype": rows.dtype, "precision": self.precision}
            a = build(Embed, embedding=self.lora_a, **config)(ids)  # read as a table's rows
            return rows + project(
                self.scale * a, self.lora_b.astype(rows.dtype), None, self.precision
            )

    def attend(self, x: Float[Array, "*batch features"]) -> Float[Array, "*batch num_embeddings"]:
        """Scores `x` against every row of the adapted table: the base's
        :meth:`~Embed.attend` plus ``scale * (x @ lora_b.T) @ lora_a.T``.

        Args:
            x: ``[*batch, features]``.

        Returns:
            ``[*batch, num_embeddings]`` (logits), in the dtype the base returns.

        Raises:
            ValueError: the last axis of `x` does not have ``features`` entries.
        """
        with jax.named_scope("LoRAEmbed.attend"):
            y = _base(self).attend(x)
            down = project(x.astype(y.dtype), self.lora_b.astype(y.dtype).T, None, self.precision)
            return y + project(
                self.scale * down, self.lora_a.astype(y.dtype).T, None, self.precision
            )


_LINEARS = (Linear, QuantizedLinear)
_EMBEDS = (Embed, QuantizedEmbed)
_ADAPTABLE = {Linear: LoRALinear, QuantizedLinear: LoRALinear, Embed: LoRAEmbed}
_ADAPTABLE[QuantizedEmbed] = LoRAEmbed
_ADAPTED = (LoRALinear, LoRAEmbed)


def _base(layer: LoRALinear | LoRAEmbed) -> Any:
    """The plain layer an adapted one was made from (its weights as they are)."""
    config = {"dtype": layer.dtype, "precision": layer.precision}
    if isinstance(layer, LoRALinear):
        cls = QuantizedLinear if isinstance(layer.kernel, QArray) else Linear
        return build(cls, kernel=layer.kernel, bias=layer.bias, **config)
    cls = QuantizedEmbed if isinstance(layer.embedding, QArray) else Embed
    return build(cls, embedding=layer.embedding, **config)


def _modules(tree: Any, prefix: str = "") -> Iterator[tuple[str, Module]]:
    """Every module in `tree` with its flat name, outer ones first."""
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Module))[0]
    for path, node in found:
        if isinstance(node, Module):
            name = ".".join([*([prefix] if prefix else []), *map(key_name, path)])
            yield name, node
            for field_name, value in fields_of(node).items():
                yield from _modules(value, f"{name}.{field_name}" if name else field_name)


def _is_layer(x: Any) -> bool:
    return isinstance(x, Module) and type(x)._taktiny_base in (*_ADAPTABLE, *_ADAPTED)


def _why_not(pattern: str, modules: dict[str, Module], leaves: Sequence[str]) -> str:
    """Why the target `pattern` adapts nothing: what it matches instead, or the closest name."""
    regex = compile_pattern(pattern)
    for name, module in modules.items():
        if regex.fullmatch("." + name):
            kind = type(module)._taktiny_base
            if kind in _ADAPTED:
                return (
                    f"it matches {name!r}, which already has an adapter ({kind.__name__}); "
                    f"merge it first (taktiny.merge_lora) or leave it out of the targets"
                )
            return (
                f"it matches {name!r}, a {kind.__name__}, which is not an adaptable layer "
                f"(Linear, QuantizedLinear, Embed, QuantizedEmbed); name the layers inside "
                f"it ('{pattern}.*' or '{pattern}.**')"
            )
    leaf = next((n for n in leaves if regex.fullmatch("." + n)), None)
    if leaf is not None:
        layer = leaf.rsplit(".", 1)[0] if "." in leaf else leaf
        return f"it matches the parameter {leaf!r}, not a layer; name the layer ({layer!r})"
    return unused_hint(pattern, list(modules)) if modules else "the model has no modules"


def lora(
    model: Any,
    rank: int,
    *,
    targets: str | Sequence[str],
    alpha: float | int | None = None,
    rngs: Rngs,
) -> Any:
    """`model` with a low-rank adapter on every layer that `targets` names: each
    :class:`~taktiny.nn.Linear` and :class:`~taktiny.nn.QuantizedLinear` becomes a
    :class:`~taktiny.nn.LoRALinear`, each :class:`~taktiny.nn.Embed` and
    :class:`~taktiny.nn.QuantizedEmbed` a :class:`~taktiny.nn.LoRAEmbed`.

    The base weights keep their flat names and are not trained; each adapted layer gains
    ``<layer>.lora_a`` and ``<layer>.lora_b``, with ``lora_b`` zeros, so the model's
    output is unchanged until it is trained. The adapters are placed as their base weights
    are (``lora_a`` split as the weight's first axis, ``lora_b`` as its second). Layers
    are adapted in the order of their names, each drawing one key from `rngs`. Works on
    an abstract model (from ``jax.eval_shape``), whose adapters are then abstract too.

    Args:
        model: a module, or any PyTree holding modules; it is not changed.
        rank: the rank of every adapter.
        targets: a pattern over layer names, or a list of them, in the language of
            :func:`taktiny.shard` (``"layers.*.attention.query"``,
            ``"**.attention.*"``, ``"**.mlp.*"``); each must match at least one adaptable
            layer.
        alpha: the scale's numerator, ``scale = alpha / rank``; None for ``alpha = rank``.
        rngs: the key stream the adapters are drawn from.

    Returns:
        The adapted model.

    Raises:
        ValueError: a target matches no adaptable layer (the error names it, and what it
            matches instead: a module of another kind, a parameter, an adapted layer, or
            the closest name), a target is not a valid pattern, or `rank` is not a
            positive int.
        TypeError: `targets` is not a string or a list of strings, or `alpha` is not a
            number.
    """
    patterns = [targets] if isinstance(targets, str) else list(targets)
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise TypeError(
            f"taktiny.lora: targets is a layer-name pattern ('**.attention.*') or a non-empty "
            f"list of them, got {targets!r}."
        )
    _scale(rank, alpha, "taktiny.lora")
    compiled = [compile_pattern(p) for p in patterns]
    found = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_layer)[0]
    layers = {
        ".".join(map(key_name, path)): x
        for path, x in found
        if _is_layer(x) and type(x)._taktiny_base in _ADAPTABLE
    }
    chosen = {n for n in layers if any(r.fullmatch("." + n) for r in compiled)}
    hits = {
        p: any(r.fullmatch("." + n) for n in layers)
        for p, r in zip(patterns, compiled, strict=True)
    }
    problems = [p for p, hit in hits.items() if not hit]
    if problems:
        modules = dict(_modules(model))
        leaves = flatten(model)[2].names
        lines = "".join(f"\n  - {p!r}: {_why_not(p, modules, leaves)}" for p in problems)
        raise ValueError(
            f"taktiny.lora: {len(problems)} target(s) match no Linear, QuantizedLinear, Embed "
            f"or QuantizedEmbed layer, so nothing would be adapted there:{lines}"
        )
    keys = {name: rngs() for name in sorted(chosen)}

    def swap(path: Any, layer: Any) -> Any:
        name = ".".join(map(key_name, path))
        if name not in keys:
            return layer
        adapter = _ADAPTABLE[type(layer)._taktiny_base]
        return adapter(layer, rank, alpha=alpha, rngs=Rngs(keys[name]))

    return jax.tree_util.tree_map_with_path(swap, model, is_leaf=_is_layer)


def _merged(layer: LoRALinear | LoRAEmbed, name: str) -> tuple[Module, Any, Any]:
    """The plain layer with ``scale * lora_a @ lora_b`` added to its weight (in float32),
    placed as the weight was; the weight it held, and the one it now holds."""
    base = _base(layer)
    field_name = "kernel" if isinstance(layer, LoRALinear) else "embedding"
    weight = getattr(base, field_name)
    delta = jnp.matmul(
        layer.lora_a.astype(jnp.float32),
        layer.lora_b.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    if isinstance(weight, QArray):
        summed = jnp.asarray(weight.dequantize(jnp.float32)) + layer.scale * delta
        new = _placed_like(quantize_like(summed, weight, name=f"{name}.{field_name}"), weight)
    else:
        summed = weight.astype(jnp.float32) + layer.scale * delta
        new = _placed_like(summed.astype(weight.dtype), weight)
    return base.replace(**{field_name: new}), weight, new


def _on_host(weight: Any) -> np.ndarray:
    """`weight`'s values in float64 on the host: a QArray's integers times its scales,
    which float64 holds exactly."""
    if not isinstance(weight, QArray):
        return np.asarray(weight).astype(np.float64)
    value, scale = (np.asarray(p).astype(np.float64) for p in (weight.value, weight.scale))
    if weight.group_size is not None:  # each scale over its group of entries along `axis`
        scale = np.repeat(scale, weight.group_size, axis=weight.axis)
    return value * scale


def _merge_error(layer: LoRALinear | LoRAEmbed, weight: Any, new: Any, name: str) -> float:
    """The largest absolute difference between `new`, the weight merged from `layer`
    (whose base weight is `weight`), and ``weight + scale * lora_a @ lora_b`` computed
    exactly (in float64 on the host)."""
    parts = (layer.lora_a, layer.lora_b, *jax.tree.leaves((weight, new)))
    if any(isinstance(p, Tracer) for p in parts):
        raise TypeError(
            f"taktiny.merge_lora(report=True): {name!r} holds traced values; the report "
            f"compares each merged weight with the exact sum computed with NumPy on the "
            f"host, so it takes concrete arrays. Call it outside jax.jit, or with "
            f"report=False inside."
        )
    a, b = (np.asarray(f).astype(np.float64) for f in (layer.lora_a, layer.lora_b))
    exact = _on_host(weight) + layer.scale * (a @ b)
    return float(np.max(np.abs(_on_host(new) - exact), initial=0.0))


def _placed_like(new: Any, old: Any) -> Any:
    """`new` (an array or a QArray) with each leaf placed as the same leaf of `old` is,
    where that is a ``NamedSharding`` (inside a trace, as the computation placed it)."""

    def place(n: Any, o: Any) -> Any:
        sharding = getattr(o, "sharding", None)
        if isinstance(sharding, NamedSharding) and not isinstance(n, Tracer):
            return jax.device_put(n, sharding)
        return n

    return jax.tree.map(place, new, old)


@overload
def merge_lora(model: Any, *, report: Literal[False] = False) -> Any: ...
@overload
def merge_lora(model: Any, *, report: Literal[True]) -> tuple[Any, dict[str, float]]: ...
def merge_lora(model: Any, *, report: bool = False) -> Any:
    """`model` with every adapter merged into its base weight: each
    :class:`~taktiny.nn.LoRALinear` and :class:`~taktiny.nn.LoRAEmbed` becomes the plain
    layer it was made from, holding ``W + scale * lora_a @ lora_b``.

    The result has exactly the flat names and tree structure of the model before
    :func:`lora`. The sum is computed in float32 (at full matmul precision) and stored in
    the weight's dtype, placed as the weight was; a quantized weight (QLoRA) is
    dequantized, summed and quantized again with its own bits, axis, group size and scale
    dtype. Both round: ask for ``report=True`` to see by how much.

    Args:
        model: a module, or any PyTree holding modules; it is not changed.
        report: also return, for each merged layer's name, how far the merged layer is
            from the adapted one: the largest absolute difference, entry by entry,
            between the weight it now holds (dequantized exactly, for a quantized one)
            and the weight the adapted layer stands for, ``W + scale * lora_a @ lora_b``
            computed exactly (NumPy, float64, on the host; ``W`` dequantized exactly).
            Float32 rounding for a float32 weight (a few units in the last place of its
            largest entries), bfloat16 rounding for a bfloat16 one, up to about half a
            quantization step for a quantized one. For an input ``x`` the outputs of the
            two layers then differ by at most this times ``sum(abs(x))`` (plus the
            rounding of the products themselves). The report takes concrete arrays (not
            inside ``jax.jit``) and copies each weight to the host.

    Returns:
        The merged model; with `report`, ``(model, {layer name: float})``.

    Raises:
        TypeError: `report` is true and the model holds traced values (inside
            ``jax.jit``).
    """
    errors: dict[str, float] = {}

    def swap(path: Any, layer: Any) -> Any:
        if not isinstance(layer, _ADAPTED):
            return layer
        name = ".".join(map(key_name, path))
        merged, weight, new = _merged(layer, name)
        if report:
            errors[name] = _merge_error(layer, weight, new, name)
        return merged

    is_adapted = lambda x: isinstance(x, _ADAPTED)
    merged = jax.tree_util.tree_map_with_path(swap, model, is_leaf=is_adapted)
    return (merged, errors) if report else merged
