"""`LayerNorm` and `RMSNorm`: normalisation over the last axis of each example."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from ..arrays import Spec
from ..module import Module, Rngs
from ._explicit import follow
from ._layer_checks import check_features
from ._precision import DTYPE, compute_dtype, static_dtype
from ._random import constant, unit_scale, zero_bias


def statistics_dtype(dtype: DTypeLike) -> jnp.dtype:
    """The dtype norms compute their statistics in: `dtype`, but at least float32, so that a
    bfloat16 or float16 layer does not lose the mean of large inputs to rounding."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if jnp.finfo(dtype).bits < 32 else dtype


def output_dtype(layer: str, x: jax.Array, scale: Any, bias: Any, dtype: Any) -> jnp.dtype:
    """Checks `x`'s features against a norm's `scale` or `bias` (either may be None) and
    returns the dtype it outputs: its `dtype`, else its parameters', else the input's."""
    param = scale if scale is not None else bias
    if param is not None:
        size = param.shape[0]
        why = f"its {'scale' if scale is not None else 'bias'} is ({size},)"
        check_features(layer, x, size, why=why, argument="num_features")
    return compute_dtype(dtype, x if param is None else param)


def standardise(
    x: jax.Array, axes: int | tuple[int, ...], epsilon: float, *, centre: bool = True
) -> jax.Array:
    """`x` over ``sqrt(mean(x**2) + epsilon)`` on `axes`, its mean there subtracted first
    with `centre` (the mean square is then the biased variance): `x`'s shape and dtype (the
    statistics dtype, which the caller casts to)."""
    if centre:
        x = x - jnp.mean(x, axis=axes, keepdims=True)
    mean_square = jnp.mean(jnp.square(x), axis=axes, keepdims=True)
    return x * jax.lax.rsqrt(mean_square + jnp.asarray(epsilon, x.dtype))


def scale_and_shift(y: jax.Array, scale: Any, bias: Any) -> jax.Array:
    """`y` (normalised) times `scale` plus `bias` (either may be None), both in `y`'s dtype
    and, under Explicit axes, split as its last axis is."""
    if scale is not None:
        y = y * follow(scale, y).astype(y.dtype)
    if bias is not None:
        y = y + follow(bias, y).astype(y.dtype)
    return y


class LayerNorm(Module):
    """Layer normalisation: each vector on the last axis to zero mean and unit variance,
    then scaled and shifted: ``(x - mean) / sqrt(var + epsilon) * scale + bias``.

    The variance is the biased one (divided by ``num_features``), as in PyTorch.

    Attributes:
        scale: ``[num_features]``, ones; ``None`` when ``use_scale=False``
            (PyTorch's ``nn.LayerNorm.weight``).
        bias: ``[num_features]``, zeros; ``None`` when ``use_bias=False``
            (PyTorch's ``nn.LayerNorm.bias``).

    Args:
        num_features: the size of the normalised last axis.
        epsilon: added to the variance for stability (PyTorch's ``eps``, whose default
            is ``1e-5``; BERT uses ``1e-12``).
        use_scale: whether to multiply by a learned ``scale``.
        use_bias: whether to add a learned ``bias``.
        dtype: the dtype the layer computes in and returns; None (the default) is the
            parameters' dtype (the input's for a LayerNorm with neither scale nor bias,
            which has no parameters). The mean and variance are computed in this dtype
            but at least float32, and the result cast back.
        param_dtype: the dtype ``scale`` and ``bias`` are created and stored in.
        scale_sharding: how ``scale`` is split over the mesh of an enclosing
            ``jax.set_mesh``: a tuple with one mesh axis name (or None), such as
            ``("model",)``, or a ``PartitionSpec``. Ignored without a mesh. On Explicit
            mesh axes the output is split as the input is.
        bias_sharding: the same for ``bias``.
        rngs: unused (the initialisation is deterministic); accepted so that every
            layer can be built the same way.
    """

    scale: Float[Array, " num_features"] | None
    bias: Float[Array, " num_features"] | None
    epsilon: float
    dtype: jnp.dtype | None = DTYPE

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        use_scale: bool = True,
        use_bias: bool = True,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        scale_sharding: Spec | None = None,
        bias_sharding: Spec | None = None,
        rngs: Rngs | None = None,
    ):
        self.scale = unit_scale("LayerNorm", num_features, use_scale, param_dtype, scale_sharding)
        self.bias = zero_bias("LayerNorm", num_features, use_bias, param_dtype, bias_sharding)
        self.epsilon = float(epsilon)  # a NumPy scalar would be an array: a parameter
        self.dtype = static_dtype(dtype)

    def __call__(
        self, x: Float[Array, "*batch num_features"]
    ) -> Float[Array, "*batch num_features"]:
        """Normalises `x` over its last axis.

        Args:
            x: ``[*batch, num_features]``.

        Returns:
            ``[*batch, num_features]``, in ``dtype``.

        Raises:
            ValueError: the last axis of `x` does not have ``num_features`` entries.
        """
        with jax.named_scope("LayerNorm"):
            out = output_dtype("LayerNorm", x, self.scale, self.bias, self.dtype)
            y = standardise(x.astype(statistics_dtype(out)), -1, self.epsilon)
            return scale_and_shift(y, self.scale, self.bias).astype(out)


class RMSNorm(Module):
    """Root-mean-square normalisation: ``x / sqrt(mean(x**2) + epsilon) * scale`` on the
    last axis, with no centring and no bias (as in T5 and Llama).

    Attributes:
        scale: ``[num_features]``, ones (PyTorch's ``nn.RMSNorm.weight``).

    Args:
        num_features: the size of the normalised last axis.
        epsilon: added to the mean square for stability (PyTorch's ``eps``; give it
            explicitly there, as its default depends on the dtype).
        dtype: the dtype the layer computes in and returns; None (the default) is the
            parameter's dtype. The mean square is computed in this dtype but at least
            float32, and the result cast back.
        param_dtype: the dtype ``scale`` is created and stored in.
        scale_sharding: how ``scale`` is split over the mesh of an enclosing
            ``jax.set_mesh`` (``("model",)``, or a ``PartitionSpec``); ignored without a
            mesh. On Explicit mesh axes the output is split as the input is.
        rngs: unused (the initialisation is deterministic).
    """

    scale: Float[Array, " num_features"]
    epsilon: float
    dtype: jnp.dtype | None = DTYPE

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        scale_sharding: Spec | None = None,
        rngs: Rngs | None = None,
    ):
        self.scale = constant(1, (num_features,), param_dtype, scale_sharding, "RMSNorm.scale")
        self.epsilon = float(epsilon)  # a NumPy scalar would be an array: a parameter
        self.dtype = static_dtype(dtype)

    def __call__(
        self, x: Float[Array, "*batch num_features"]
    ) -> Float[Array, "*batch num_features"]:
        """Scales `x` by the root mean square of its last axis (no mean is taken away).

        Args:
            x: ``[*batch, num_features]``.

        Returns:
            ``[*batch, num_features]``, in ``dtype``; raises as :meth:`LayerNorm.__call__`.
        """
        with jax.named_scope("RMSNorm"):
            out = output_dtype("RMSNorm", x, self.scale, None, self.dtype)
            y = standardise(x.astype(statistics_dtype(out)), -1, self.epsilon, centre=False)
            return scale_and_shift(y, self.scale, None).astype(out)
