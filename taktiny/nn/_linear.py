"""`Linear`: a dense layer on the last axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from ..arrays import Spec
from ..module import Module, Rngs
from ._explicit import project
from ._layer_checks import check_features
from ._precision import DTYPE, PRECISION, compute_dtype, static_dtype, static_precision
from ._random import lecun_normal, zero_bias


class Linear(Module):
    """A dense layer: ``y = x @ kernel + bias`` on the last axis of any batch shape.

    Attributes:
        kernel: ``[in_features, out_features]``, LeCun-normal initialised (normal with
            variance ``1 / in_features``; PyTorch's ``nn.Linear`` stores the transpose,
            ``weight`` ``[out, in]``).
        bias: ``[out_features]``, zeros; ``None`` (and absent from the state) when
            ``use_bias=False``.

    Args:
        in_features: size of the input's last axis.
        out_features: size of the output's last axis.
        use_bias: whether to add a bias.
        dtype: the dtype the layer computes in and returns (inputs and parameters are
            cast to it); None (the default) computes in the parameters' dtype.
        param_dtype: the dtype the parameters are created and stored in.
        precision: the precision of the matrix product (``jax.lax.Precision`` or its
            name, ``"highest"`` for full float32 on GPUs and TPUs); None uses JAX's
            default, which is TF32 for float32 on recent NVIDIA GPUs.
        kernel_sharding: how ``kernel`` is split over the mesh of an enclosing
            ``jax.set_mesh``: a tuple of mesh axis names, one per axis (``(None, "model")``
            splits the outputs), or a ``PartitionSpec``. Ignored without a mesh.
        bias_sharding: the same for ``bias`` (``("model",)``).
        rngs: the key stream for the initialisation.
    """

    kernel: Float[Array, "in_features out_features"]
    bias: Float[Array, " out_features"] | None
    dtype: jnp.dtype | None = DTYPE
    precision: jax.lax.PrecisionLike = PRECISION

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        precision: jax.lax.PrecisionLike = None,
        kernel_sharding: Spec | None = None,
        bias_sharding: Spec | None = None,
        rngs: Rngs,
    ):
        shape = (in_features, out_features)
        self.kernel = lecun_normal(rngs(), shape, param_dtype, kernel_sharding, "Linear.kernel")
        self.bias = zero_bias("Linear", out_features, use_bias, param_dtype, bias_sharding)
        self.dtype = static_dtype(dtype)
        self.precision = static_precision(precision, "Linear")

    def __call__(
        self, x: Float[Array, "*batch in_features"]
    ) -> Float[Array, "*batch out_features"]:
        """Applies the layer to the last axis of `x`.

        Args:
            x: ``[*batch, in_features]``, any number of batch axes.

        Returns:
            ``[*batch, out_features]``, in ``dtype`` (by default the parameters').

        Raises:
            ValueError: the last axis of `x` does not have ``in_features`` entries.
        """
        with jax.named_scope("Linear"):
            shape = tuple(self.kernel.shape)
            check_features(
                "Linear", x, shape[0], why=f"its kernel is {shape}", argument="in_features"
            )
            dtype = compute_dtype(self.dtype, self.kernel)
            bias = None if self.bias is None else self.bias.astype(dtype)
            return project(x.astype(dtype), self.kernel.astype(dtype), bias, self.precision)
