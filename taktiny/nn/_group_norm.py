"""`GroupNorm`: normalisation over groups of channels and the spatial axes of each example."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from ..arrays import Spec
from ..module import Module, Rngs
from ._explicit import explicit_axes, typed_spec
from ._layer_checks import divisors
from ._norm import output_dtype, scale_and_shift, standardise, statistics_dtype
from ._precision import DTYPE, static_dtype
from ._random import unit_scale, zero_bias


def _grouped(x: jax.Array, groups: int) -> jax.Array:
    """``[..., features]`` to ``[..., groups, features // groups]``; under Explicit axes the
    groups are split as the features were when the mesh axes divide their number (each
    device then holds whole groups), unsplit otherwise."""
    shape = (*x.shape[:-1], groups, x.shape[-1] // groups)
    if not explicit_axes():
        return x.reshape(shape)
    *batch, features = typed_spec(x)
    names = features if isinstance(features, tuple) else (features,)
    parts = math.prod(jax.sharding.get_abstract_mesh().shape[n] for n in names if n)
    split = features if groups % parts == 0 else None
    return x.reshape(shape, out_sharding=P(*batch, split, None))


class GroupNorm(Module):
    """Group normalisation, as PyTorch's ``nn.GroupNorm`` on channels-last inputs: the
    ``num_features`` channels are split into ``num_groups`` groups of consecutive channels,
    and each example's group, over all its spatial positions, is normalised to zero mean
    and unit variance, then scaled and shifted per channel:
    ``(x - mean) / sqrt(var + epsilon) * scale + bias``.

    Inputs are ``[batch, *spatial, num_features]``: the first axis is the batch (each
    example is normalised on its own), the last the channels, and any axes between them
    (none too) are spatial. The variance is the biased one, as in PyTorch.
    ``num_groups=1`` normalises each example over all its axes; ``num_groups=num_features``
    is instance normalisation.

    Attributes:
        scale: ``[num_features]``, ones; ``None`` when ``use_scale=False`` (PyTorch's
            ``nn.GroupNorm.weight``).
        bias: ``[num_features]``, zeros; ``None`` when ``use_bias=False`` (PyTorch's
            ``nn.GroupNorm.bias``).

    Args:
        num_groups: the number of groups; must divide ``num_features``.
        num_features: the number of channels, the input's last axis.
        epsilon: added to the variance for stability (PyTorch's ``eps``).
        use_scale: whether to multiply by a learned ``scale``.
        use_bias: whether to add a learned ``bias`` (PyTorch's ``affine=False`` is neither).
        dtype: the dtype of the output; None (the default) is the parameters' dtype, or
            the input's when there are none. The mean and variance are computed in this
            dtype but at least float32, and the result cast back.
        param_dtype: the dtype ``scale`` and ``bias`` are created and stored in.
        scale_sharding: how ``scale`` is split over the mesh, as for :class:`LayerNorm`.
        bias_sharding: the same for ``bias``.
        rngs: unused, as for :class:`LayerNorm`.

    Raises:
        ValueError: `num_groups` does not divide `num_features`.
    """

    scale: Float[Array, " num_features"] | None
    bias: Float[Array, " num_features"] | None
    num_groups: int
    epsilon: float
    dtype: jnp.dtype | None = DTYPE

    def __init__(
        self,
        num_groups: int,
        num_features: int,
        *,
        epsilon: float = 1e-5,
        use_scale: bool = True,
        use_bias: bool = True,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        scale_sharding: Spec | None = None,
        bias_sharding: Spec | None = None,
        rngs: Rngs | None = None,
    ):
        if num_groups < 1 or num_features % num_groups:
            raise ValueError(
                f"GroupNorm's num_groups ({num_groups}) must divide num_features "
                f"({num_features}) into groups of equal size; pass one of "
                f"{divisors(num_features)} as num_groups, or change num_features."
            )
        self.scale = unit_scale("GroupNorm", num_features, use_scale, param_dtype, scale_sharding)
        self.bias = zero_bias("GroupNorm", num_features, use_bias, param_dtype, bias_sharding)
        self.num_groups = int(num_groups)
        self.epsilon = float(epsilon)  # a NumPy scalar would be an array: a parameter
        self.dtype = static_dtype(dtype)

    def __call__(
        self, x: Float[Array, "batch *spatial num_features"]
    ) -> Float[Array, "batch *spatial num_features"]:
        """Normalises each example's groups of channels in `x`.

        Args:
            x: ``[batch, *spatial, num_features]``, channels last, with any number of
                spatial axes (none too).

        Returns:
            ``[batch, *spatial, num_features]``, in ``dtype``.

        Raises:
            ValueError: `x` has fewer than two axes, or a last axis of another size than
                ``num_features`` (for a layer without parameters: one ``num_groups`` does
                not divide).
        """
        with jax.named_scope("GroupNorm"):
            groups = self.num_groups
            if x.ndim < 2:
                raise ValueError(
                    f"GroupNorm expects inputs [batch, *spatial, num_features] (channels last, "
                    f"the first axis the batch), got an input of shape {tuple(x.shape)}. Add a "
                    f"batch axis: x[None]."
                )
            out = output_dtype("GroupNorm", x, self.scale, self.bias, self.dtype)
            if self.scale is None and self.bias is None and x.shape[-1] % groups:
                raise ValueError(
                    f"GroupNorm's num_groups ({groups}) must divide the input's features, got "
                    f"an input of shape {tuple(x.shape)}. Pass inputs whose last axis is a "
                    f"multiple of {groups}, or build the layer with another num_groups."
                )
            h = _grouped(x.astype(statistics_dtype(out)), groups)  # [batch, *spatial, groups, per]
            h = standardise(h, (*range(1, h.ndim - 2), h.ndim - 1), self.epsilon)
            unsplit = P(*typed_spec(x)) if explicit_axes() else None
            y = h.reshape(x.shape, out_sharding=unsplit)  # x's split again
            return scale_and_shift(y, self.scale, self.bias).astype(out)
