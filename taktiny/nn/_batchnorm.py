"""`BatchNorm`: batch normalisation with running statistics kept in the state."""

from __future__ import annotations

from typing import Literal, overload

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from ..arrays import Spec
from ..module import Module, Rngs, field
from ._explicit import explicit_axes, follow, typed_spec
from ._norm import output_dtype, statistics_dtype
from ._precision import DTYPE, static_dtype
from ._random import constant
from ._training import latest, record, training


class BatchNorm(Module):
    """Batch normalisation over every axis but the last (channels last).

    Inference, ``bn(x)``, normalises with the running statistics:
    ``(x - mean) / sqrt(var + epsilon) * scale + bias``.

    Training normalises with the statistics of the batch (the biased variance) and moves
    the running statistics towards them, ``running = momentum * running + (1 - momentum)
    * batch``, where the variance entering the update is the unbiased one (``n / (n - 1)``
    times the biased), exactly as PyTorch does. A PyTorch ``momentum`` of ``m`` is a
    Taktiny ``momentum`` of ``1 - m`` (PyTorch's default 0.1 is 0.9 here). Nothing is
    changed in place; there are two ways to get the updated layer:

    - in a model, however deep the BatchNorm sits, :func:`train_forward` runs the model
      in training mode and returns ``(output, model_with_new_statistics)``;
    - called directly, ``bn(x, train=True)`` returns ``(y, new_bn)``, and a
      :class:`Sequential` called with ``train=True`` hands the flag on and returns
      ``(y, new_sequential)``.

    The running statistics are state, not parameters: they are declared
    ``field(trainable=False)``, so :func:`taktiny.trainable` marks them ``False`` (for
    optax's masks and labels), and no gradient flows into them.

    The layer computes in ``dtype`` (by default the parameters' dtype), and its
    statistics in that dtype but at least float32; the output has ``dtype``, and the
    running statistics stay in ``param_dtype``, whatever ``dtype`` is.

    The state names follow; PyTorch's ``nn.BatchNorm{1,2,3}d`` names are in brackets.
    PyTorch's ``num_batches_tracked`` has no counterpart (it only matters for
    ``momentum=None``); drop it when converting.

    Attributes:
        scale: ``[num_features]``, ones (``weight``).
        bias: ``[num_features]``, zeros (``bias``).
        mean: ``[num_features]``, the running mean, zeros (``running_mean``); not trained.
        var: ``[num_features]``, the running variance, ones (``running_var``); not trained.

    Args:
        num_features: the size of the last (channel) axis.
        momentum: the weight of the old running statistics in each update.
        epsilon: added to the variance for stability (PyTorch's ``eps``).
        dtype: the dtype the layer computes in and returns; None (the default) is the
            parameters' dtype.
        param_dtype: the dtype ``scale``, ``bias`` and the running ``mean`` and ``var``
            are created and stored in (a float32 BatchNorm computing in bfloat16 keeps
            float32 statistics).
        scale_sharding: how ``scale`` is split over the mesh of an enclosing
            ``jax.set_mesh``: a tuple with one mesh axis name (or None), such as
            ``("model",)``, or a ``PartitionSpec``. Ignored without a mesh. The running
            ``mean`` and ``var`` are created split as ``scale`` is; on Explicit mesh axes
            training keeps their split and the output is split as the input is (on Auto
            axes the compiler, or ``jax.jit``'s ``out_shardings``, decides).
        bias_sharding: the same for ``bias``.
        rngs: unused (the initialisation is deterministic).

    Raises:
        ValueError: `momentum` is outside [0, 1].
    """

    scale: Float[Array, " num_features"]
    bias: Float[Array, " num_features"]
    mean: Float[Array, " num_features"] = field(trainable=False)
    var: Float[Array, " num_features"] = field(trainable=False)
    momentum: float
    epsilon: float
    dtype: jnp.dtype | None = DTYPE

    def __init__(
        self,
        num_features: int,
        *,
        momentum: float = 0.99,
        epsilon: float = 1e-5,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        scale_sharding: Spec | None = None,
        bias_sharding: Spec | None = None,
        rngs: Rngs | None = None,
    ):
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(
                f"BatchNorm's momentum is the weight of the old running statistics, in [0, 1]; "
                f"got {momentum!r} (a PyTorch momentum m is 1 - m here)."
            )
        shape, stored = (num_features,), param_dtype
        self.scale = constant(1, shape, stored, scale_sharding, "BatchNorm.scale")
        self.bias = constant(0, shape, stored, bias_sharding, "BatchNorm.bias")
        self.mean = constant(0, shape, stored, scale_sharding, "BatchNorm.mean")
        self.var = constant(1, shape, stored, scale_sharding, "BatchNorm.var")
        self.momentum = float(momentum)  # a NumPy scalar would be an array: a parameter
        self.epsilon = float(epsilon)  # a NumPy scalar would be an array: a parameter
        self.dtype = static_dtype(dtype)

    @overload
    def __call__(
        self, x: Float[Array, "*batch num_features"], *, train: Literal[False, None] = None
    ) -> Float[Array, "*batch num_features"]: ...

    @overload
    def __call__(
        self, x: Float[Array, "*batch num_features"], *, train: Literal[True]
    ) -> tuple[Float[Array, "*batch num_features"], BatchNorm]: ...

    def __call__(
        self, x: Float[Array, "*batch num_features"], *, train: bool | None = None
    ) -> (
        Float[Array, "*batch num_features"] | tuple[Float[Array, "*batch num_features"], BatchNorm]
    ):
        """Normalises `x` with the running statistics, or in training with the batch's.

        Args:
            x: ``[*batch, num_features]``, channels last.
            train: None (the default) trains under :func:`train_forward` and infers
                otherwise; ``False`` always infers; ``True`` trains and returns the new
                layer too.

        Returns:
            ``y``, ``[*batch, num_features]`` in ``dtype``; with ``train=True`` the pair
            ``(y, new_bn)``, ``new_bn`` holding the updated running statistics.

        Raises:
            ValueError: the last axis of `x` does not have ``num_features`` entries, or
                training gets a single value per feature (no variance to estimate).
        """
        with jax.named_scope("BatchNorm"):
            dtype = output_dtype("BatchNorm", x, self.scale, self.bias, self.dtype)
            x = x.astype(statistics_dtype(dtype))
            if not (training() if train is None else train):
                return self._normalise(x, self.mean, self.var).astype(dtype)
            axes = tuple(range(x.ndim - 1))
            count = x.size // x.shape[-1]
            if count < 2:
                raise ValueError(
                    f"BatchNorm in training needs more than one value per feature to estimate "
                    f"a variance, got an input of shape {tuple(x.shape)}; use a larger batch, "
                    f"or call it with train=False to use the running statistics."
                )
            mean = jnp.mean(x, axis=axes)
            var = jnp.mean(jnp.square(x - mean), axis=axes)
            y = self._normalise(x, mean, var).astype(dtype)
            mean, unbiased = jax.lax.stop_gradient((mean, var * (count / (count - 1))))
            base = latest(self) if train is None else self
            if explicit_axes():  # the running statistics keep their own split
                splits = P(*typed_spec(base.mean)), P(*typed_spec(base.var))
                mean, unbiased = jax.sharding.reshard((mean, unbiased), splits)
            m = base.momentum
            new = base.replace(  # the running statistics keep their own dtype
                mean=(m * base.mean.astype(mean.dtype) + (1 - m) * mean).astype(base.mean.dtype),
                var=(m * base.var.astype(mean.dtype) + (1 - m) * unbiased).astype(base.var.dtype),
            )
            if train is None:
                record(self, new)
                return y
            return y, new

    def _normalise(self, x: jax.Array, mean: jax.Array, var: jax.Array) -> jax.Array:
        """``x`` normalised in ``x``'s dtype (the statistics dtype)."""
        # under Explicit axes every vector is split as x's features are
        scale, bias = follow(self.scale, x).astype(x.dtype), follow(self.bias, x).astype(x.dtype)
        mean, var = follow(mean, x).astype(x.dtype), follow(var, x).astype(x.dtype)
        return (x - mean) * jax.lax.rsqrt(var + self.epsilon) * scale + bias
