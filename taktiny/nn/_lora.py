"""Low-rank adapters (LoRA): `LoRALinear` and `LoRAEmbed`, which add ``scale * A @ B`` to a
frozen base weight. `tt.lora` and `tt.merge_lora` (``_surgery.py``) put them into a whole
model and take them out again.

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
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Integer

from ..module import Module, Rngs, field
from ..quant import QArray
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

    The base layer computes its output as it would alone (a quantized kernel as
    :class:`QuantizedLinear` applies it), and the adapter's term is added to it, computed
    from the activations through the rank: two skinny products, ``[*batch, in] @ [in, rank]`` then
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
