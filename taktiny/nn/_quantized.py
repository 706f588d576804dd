"""`QuantizedLinear` and `QuantizedEmbed`: `Linear` and `Embed` with `QArray` weights.
`tt.quantize` and `tt.dequantize` (``_surgery.py``) swap them for the float layers in a
whole model."""

from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Integer

from ..arrays import Spec, default_device
from ..module import Module, Rngs, finalise
from ..quant import QArray, dequantize_array, quantized
from ._explicit import explicit_axes, follow, free, project, typed_spec
from ._grouped_product import grouped_product, takes
from ._layer_checks import check_features, check_ids
from ._precision import DTYPE, PRECISION, compute_dtype, static_dtype, static_precision
from ._random import lecun_normal, normal, zero_bias


def layer_dtype(weight: QArray, dtype: jnp.dtype | None, x: Any) -> jnp.dtype:
    """The dtype a quantized layer computes in on input `x`: its `dtype`; when that is
    None, the input's if it is float, else the scales'."""
    if dtype is None and jnp.issubdtype(x.dtype, jnp.floating):
        dtype = jnp.dtype(x.dtype)
    return compute_dtype(dtype, weight)


def quantized_project(
    x: jax.Array,
    weight: QArray,
    bias: jax.Array | None,
    precision: jax.lax.PrecisionLike,
    *,
    rows: bool = False,
) -> jax.Array:
    """``x @ dequantize(weight) + bias`` on the last axis of `x` (already in the dtype the
    layer computes in), or ``x @ dequantize(weight).T`` with `rows` (a table quantized
    along its features, scored by `QuantizedEmbed.attend`). With one scale per output
    channel, quantized along the contracted axis, the integers enter the product (only
    converted, which XLA may fuse into the product's read of the weight) and the scales
    multiply its ``[*batch, out]`` result rather than the weight: ``(x @ q) * s`` equals
    ``x @ (q * s)`` up to rounding (the integers are exact in any float dtype). The
    product is taken in float32, where the unscaled sums cannot overflow (in float16 they
    would: 4096 inputs of 8 times 127 exceed its range before the scales bring them back),
    scaled, and rounded into the dtype once. With groups, the weight is dequantized first;
    on a TPU, int4 in groups of 128 at decode batches goes through a Pallas kernel that
    dequantizes tile by tile instead (`grouped_product`, where `takes` says). A float32
    input on a TPU at the default precision, whose product takes bfloat16 operands there,
    gets its weight made into bfloat16, never float32 (`halved_product`), a grouped
    table made once for the forward's and the backward's products (QLoRA's step 0.94x
    LoRA's on an int8 base, 1.02x on int4, from 1.09x and 1.23x: bench/FINDINGS.md 18).

    Args:
        x: ``[*batch, in]``, in the dtype the layer computes in.
        weight: ``[in, out]`` (``[out, in]`` with `rows`).
        bias: ``[out]``, in that dtype, or None.
        precision: the product's precision.

    Returns:
        ``[*batch, out]``, in `x`'s dtype.
    """
    dtype, contracted = x.dtype, 1 if rows else 0
    if not rows and not explicit_axes() and takes(x, weight):  # int4 groups on one TPU
        y = grouped_product(x, weight, precision)
        return y if bias is None else y + bias
    halved = not rows and weight.axis == 0 and _halved(x, precision)  # float32 on a TPU
    if weight.group_size is not None or weight.axis != contracted:
        table = dequantize_array(
            weight.value, weight.scale, axis=weight.axis, group_size=weight.group_size, dtype=dtype
        )
        if not halved:
            return project(x, table.T if rows else table, bias, precision)
        # made in float32, rounded once, and held for both products: fused into each instead,
        # the scales' broadcast was held in float32, twice the table (bench/FINDINGS.md 18)
        y = halved_product(x, jax.lax.optimization_barrier(table.astype(jnp.bfloat16)), None)
        return y if bias is None else y + bias
    scale = jnp.squeeze(weight.scale, contracted).astype(jnp.float32)
    if halved:  # (the integers: exact in bfloat16)
        y = halved_product(x, weight.value.astype(jnp.bfloat16), scale).astype(dtype)
        return y if bias is None else y + bias
    value = weight.value.astype(dtype)  # (the integers: exact)
    y = project(x, value.T if rows else value, None, precision, jnp.float32)
    y = (y * follow(scale, y)).astype(dtype)
    return y if bias is None else y + follow(bias, y)


def _halved(x: jax.Array, precision: jax.lax.PrecisionLike) -> bool:
    """Whether the float32 product of `x` runs on a TPU at its default precision, which
    takes each operand rounded to bfloat16 (one pass, float32 sums): then a quantized
    weight is made into bfloat16 for it, never float32 (`halved_product`)."""
    default = precision in (None, jax.lax.Precision.DEFAULT)
    configured = jax.config.jax_default_matmul_precision in (None, "default", "bfloat16")  # pyright: ignore[reportAttributeAccessIssue]  (a config option, read)
    on_tpu = default_device().platform == "tpu"
    return x.dtype == jnp.float32 and default and configured and on_tpu and not explicit_axes()


@jax.custom_vjp
def halved_product(
    x: Float[Array, "*batch in"], w: Float[Array, "in out"], scale: Float[Array, " out"] | None
) -> Float[Array, "*batch out"]:
    """``x @ (w * scale)`` as a TPU computes a float32 product at its default precision:
    `x` rounded to bfloat16, `w` bfloat16 already (a quantized weight made into it: half
    the bytes of the float32 weight XLA would otherwise write and read), float32 sums;
    the scales of an integer weight (one per output channel) multiply the product. The
    input's gradient takes its operands as the chip takes those of the float32 weight's
    product: the output's gradient rounded to bfloat16, the weight scaled and rounded (its
    product no pass of its own over the output's gradient: QLoRA's step on an int8 base
    1.02x -> 0.93x LoRA's, bench/FINDINGS.md 18). The weight's and the scales' gradients
    are computed only where they are differentiated (not a frozen base's: then neither the
    input nor the unscaled product is kept for them).

    Args:
        x: ``[*batch, in]``, float32.
        w: ``[in, out]``, bfloat16.
        scale: ``[out]``, float32, or None (`w` a table, scaled already).

    Returns:
        ``[*batch, out]``, float32.
    """
    y = jnp.matmul(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    return y if scale is None else y * scale


def _halved_forward(x: Any, w: Any, scale: Any) -> tuple[jax.Array, tuple[Any, ...]]:
    # (symbolic zeros: each argument comes with whether it is differentiated; what the
    # weight's and the scales' gradients need is kept only where they are, unlike a
    # frozen base's)
    product = halved_product(x.value, w.value, None)
    if scale is None:
        return product, (x.value if w.perturbed else None, w.value, None, None)
    kept = product if scale.perturbed else None
    saved = (x.value if w.perturbed else None, w.value, scale.value, kept)
    return product * scale.value, saved


def _halved_backward(saved: tuple[Any, ...], g: Any) -> tuple[Any, Any, Any]:
    x, w, scale, product = saved
    if isinstance(g, jax.custom_derivatives.SymbolicZero):  # (the output not differentiated)
        return None, None, None
    batch = tuple(range(g.ndim - 1))
    dscale = None if product is None else jnp.sum(g * product, axis=batch)
    operand = w if scale is None else (w.astype(jnp.float32) * scale).astype(jnp.bfloat16)
    dx = jnp.matmul(g.astype(jnp.bfloat16), operand.T, preferred_element_type=jnp.float32)
    if x is None:
        return dx, None, dscale
    scaled = g if scale is None else g * scale
    rows = x.astype(jnp.bfloat16).reshape(-1, x.shape[-1])
    columns = scaled.astype(jnp.bfloat16).reshape(-1, g.shape[-1])
    dw = jnp.matmul(rows.T, columns, preferred_element_type=jnp.float32)
    return dx, dw.astype(w.dtype), dscale


halved_product.defvjp(_halved_forward, _halved_backward, symbolic_zeros=True)


class QuantizedLinear(Module):
    """A dense layer with a quantized kernel: ``y = x @ dequantize(kernel) + bias``.

    Attributes:
        kernel: a :class:`~taktiny.QArray` of logical shape ``[in_features, out_features]``,
            quantized along the input axis 0: ``kernel.value`` ``[in, out]`` (int8 or int4)
            and ``kernel.scale`` ``[1, out]`` (one per output channel) or
            ``[in // group_size, out]``. Initialised as :class:`Linear`'s kernel, then
            quantized.
        bias: ``[out_features]``, float, zeros; ``None`` when ``use_bias=False``.

    The layer computes in ``dtype``: the input is cast to it, and the output has it. With
    one scale per output channel the integers enter the product and the scales multiply
    its result (no float kernel is scaled first); in groups, the kernel is dequantized into
    ``dtype`` first (`quantized_project`). By default (``dtype=None``) that is the input's dtype, so
    the int weights serve a float32 and a bfloat16 caller alike.

    Args:
        in_features: size of the input's last axis.
        out_features: size of the output's last axis.
        bits: 8 or 4.
        group_size: input rows per scale; None for one scale per output channel. Must
            divide `in_features`.
        use_bias: whether to add a bias.
        dtype: the dtype the layer computes in and returns; None (the default) is the
            input's dtype.
        param_dtype: the float dtype the kernel is drawn in before it is quantized, and
            that its scales and the bias are stored in (the values are int8 or int4).
        precision: the precision of the matrix product (``jax.lax.Precision`` or its
            name, ``"highest"`` for full float32 on GPUs and TPUs); None uses JAX's
            default, which is TF32 for float32 on recent NVIDIA GPUs.
        kernel_sharding: how ``kernel.value`` is split under ``jax.set_mesh``, as for
            :class:`Linear`; ``kernel.scale`` is split likewise on its output axis.
        bias_sharding: the same for ``bias``.
        rngs: the key stream for the initialisation.
    """

    kernel: QArray
    bias: Float[Array, " out_features"] | None
    dtype: jnp.dtype | None = DTYPE
    precision: jax.lax.PrecisionLike = PRECISION

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bits: int = 8,
        group_size: int | None = None,
        use_bias: bool = True,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        precision: jax.lax.PrecisionLike = None,
        kernel_sharding: Spec | None = None,
        bias_sharding: Spec | None = None,
        rngs: Rngs,
    ):
        where, stored = "QuantizedLinear.kernel", param_dtype
        w = lecun_normal(rngs(), (in_features, out_features), stored, kernel_sharding, where)
        self.kernel = quantized(w, bits=bits, axis=0, group_size=group_size, name=where)
        self.bias = zero_bias("QuantizedLinear", out_features, use_bias, stored, bias_sharding)
        self.dtype = static_dtype(dtype)
        self.precision = static_precision(precision, "QuantizedLinear")

    def __call__(
        self, x: Float[Array, "*batch in_features"]
    ) -> Float[Array, "*batch out_features"]:
        """Applies the kernel to the last axis of `x` in ``dtype`` (`quantized_project`).

        Args:
            x: ``[*batch, in_features]``, any number of batch axes, float or int.

        Returns:
            ``[*batch, out_features]``, in ``dtype`` (by default `x`'s, when it is float).

        Raises:
            ValueError: the last axis of `x` does not have ``in_features`` entries.
        """
        with jax.named_scope("QuantizedLinear"):
            shape = self.kernel.shape
            check_features(
                "QuantizedLinear", x, shape[0], why=f"its kernel is {shape}", argument="in_features"
            )
            dtype = layer_dtype(self.kernel, self.dtype, x)
            bias = None if self.bias is None else self.bias.astype(dtype)
            return quantized_project(x.astype(dtype), self.kernel, bias, self.precision)


class QuantizedEmbed(Module):
    """A table of ``num_embeddings`` quantized vectors of size ``features``, looked up by id.

    Attributes:
        embedding: a :class:`~taktiny.QArray` of logical shape ``[num_embeddings,
            features]``, quantized along the features (axis 1): ``embedding.value``
            ``[num_embeddings, features]`` and ``embedding.scale`` ``[num_embeddings, 1]``
            (one per row) or ``[num_embeddings, features // group_size]``. Initialised as
            :class:`Embed`'s table, then quantized.

    Lookups dequantize only the rows they read, into ``dtype`` (by default the scales'
    dtype, ``param_dtype``); :meth:`attend` computes in ``dtype``, by default its input's
    dtype, as :class:`QuantizedLinear` does.

    Args:
        num_embeddings: the number of ids (the vocabulary size).
        features: the size of each vector.
        bits: 8 or 4.
        group_size: features per scale; None for one scale per row. Must divide `features`.
        dtype: the dtype of the vectors looked up and the dtype :meth:`attend` computes
            in and returns; None (the default): the scales' dtype for lookups and the
            input's for :meth:`attend`.
        param_dtype: the float dtype the table is drawn in before it is quantized, and
            that its scales are stored in (the values are int8 or int4).
        precision: the precision of :meth:`attend`'s matrix product, as for
            :class:`Embed`.
        embedding_sharding: how ``embedding.value`` is split under ``jax.set_mesh``, as for
            :class:`Embed`; ``embedding.scale`` is split likewise on the vocabulary axis.
        rngs: the key stream for the initialisation.
    """

    embedding: QArray
    dtype: jnp.dtype | None = DTYPE
    precision: jax.lax.PrecisionLike = PRECISION

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        bits: int = 8,
        group_size: int | None = None,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        precision: jax.lax.PrecisionLike = None,
        embedding_sharding: Spec | None = None,
        rngs: Rngs,
    ):
        where, shape = "QuantizedEmbed.embedding", (num_embeddings, features)
        table = normal(rngs(), shape, param_dtype, 1.0, embedding_sharding, where)
        self.embedding = quantized(table, bits=bits, axis=1, group_size=group_size, name=where)
        self.dtype = static_dtype(dtype)
        self.precision = static_precision(precision, "QuantizedEmbed")

    def __call__(self, ids: Integer[Array, "*batch"]) -> Float[Array, "*batch features"]:
        """The rows of the table for `ids`, dequantized into ``dtype``.

        Ids index as in :class:`Embed`: negative ids count from the end, ids past the end
        give rows of NaNs.

        Args:
            ids: ``[*batch]``, integers.

        Returns:
            ``[*batch, features]``, in ``dtype`` (by default the scales').

        Raises:
            TypeError: `ids` is not an integer array.
        """
        with jax.named_scope("QuantizedEmbed"):
            check_ids("QuantizedEmbed", ids)
            table = self.embedding
            if not explicit_axes():
                value = jnp.take(table.value, ids, axis=0, mode="fill", fill_value=0)
                scale = jnp.take(table.scale, ids, axis=0, mode="fill", fill_value=jnp.nan)
            else:  # split as the ids, and on the features as the table (the scale: never)
                batch = typed_spec(ids)
                out = P(*batch, free(typed_spec(table.value)[1], *batch))
                value = table.value.at[ids].get(mode="fill", fill_value=0, out_sharding=out)
                out = P(*batch, None)
                scale = table.scale.at[ids].get(mode="fill", fill_value=jnp.nan, out_sharding=out)
            dtype = compute_dtype(self.dtype, table)
            return dequantize_array(
                value, scale, axis=ids.ndim, group_size=table.group_size, dtype=dtype
            )

    def attend(self, x: Float[Array, "*batch features"]) -> Float[Array, "*batch num_embeddings"]:
        """Scores `x` against every row: ``x @ dequantize(table).T``, the tied output
        projection.

        Args:
            x: ``[*batch, features]``.

        Returns:
            ``[*batch, num_embeddings]`` (logits), in ``dtype`` (by default `x`'s, when it
            is float).

        Raises:
            ValueError: the last axis of `x` does not have ``features`` entries.
        """
        with jax.named_scope("QuantizedEmbed.attend"):
            shape = self.embedding.shape
            why = f"its embedding is {shape}"
            check_features("QuantizedEmbed.attend", x, shape[1], why=why, argument="features")
            dtype = layer_dtype(self.embedding, self.dtype, x)
            return quantized_project(
                x.astype(dtype), self.embedding, None, self.precision, rows=True
            )


def build(cls: type[Module], **fields: Any) -> Any:
    """A `cls` module holding `fields` (in the order its ``__init__`` sets them), built
    without running ``__init__`` (no random draw): the module that ``__init__`` followed by
    a load would give."""
    obj: Any = types.SimpleNamespace.__new__(cls)
    obj.__dict__.update(fields)
    return finalise(obj)
