"""`BatchNorm`: batch normalisation with running statistics kept in the state."""

from __future__ import annotations

from typing import Literal, overload

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from .._module import Module
from .._rngs import Rngs
from ._checks import check_features


class BatchNorm(Module):
    """Batch normalisation over every axis but the last (channels last).

    Inference, ``bn(x)``, normalises with the running statistics:
    ``(x - mean) / sqrt(var + epsilon) * scale + bias``.

    Training, ``bn(x, train=True)``, normalises with the statistics of the batch (the
    biased variance) and returns ``(y, new_bn)``: a new BatchNorm whose running
    statistics moved towards the batch's, ``running = momentum * running + (1 - momentum)
    * batch``, where the variance entering the update is the unbiased one (``n / (n - 1)``
    times the biased), exactly as PyTorch does. A PyTorch ``momentum`` of ``m`` is a
    Taktiny ``momentum`` of ``1 - m`` (PyTorch's default 0.1 is 0.9 here). Nothing is
    changed in place: keep the returned module, typically by returning it from the
    loss as auxiliary output::

        @jax.jit
        def train_step(model, opt_state, x, y):
            def loss_fn(model):
                logits, model_with_new_stats = model(x, train=True)
                return loss(logits, y), model_with_new_stats

            (value, model), grads = jax.value_and_grad(loss_fn, has_aux=True)(model)
            updates, opt_state = optimizer.update(grads, opt_state, model)
            return optax.apply_updates(model, updates), opt_state, value

    The running statistics get zero gradients (training mode does not read them), so
    plain optimisers leave them alone; mask them out of optimisers that change
    parameters without gradients (weight decay).

    Parameters (state names; PyTorch's ``nn.BatchNorm{1,2,3}d`` names in brackets):
        scale: ``[num_features]``, ones (``weight``).
        bias: ``[num_features]``, zeros (``bias``).
        mean: ``[num_features]``, the running mean, zeros (``running_mean``).
        var: ``[num_features]``, the running variance, ones (``running_var``).
        PyTorch's ``num_batches_tracked`` has no counterpart (it only matters for
        ``momentum=None``); drop it when converting.

    Args:
        num_features: the size of the last (channel) axis.
        momentum: the weight of the old running statistics in each update.
        epsilon: added to the variance for stability (PyTorch's ``eps``).
        dtype: the parameters' dtype, which is also the dtype the layer computes in.
        rngs: unused (the initialisation is deterministic).
    """

    scale: Float[Array, " num_features"]
    bias: Float[Array, " num_features"]
    mean: Float[Array, " num_features"]
    var: Float[Array, " num_features"]
    momentum: float
    epsilon: float

    def __init__(
        self,
        num_features: int,
        *,
        momentum: float = 0.99,
        epsilon: float = 1e-5,
        dtype: DTypeLike = jnp.float32,
        rngs: Rngs | None = None,
    ):
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(
                f"BatchNorm's momentum is the weight of the old running statistics, in [0, 1]; "
                f"got {momentum!r} (a PyTorch momentum m is 1 - m here)."
            )
        self.scale = jnp.ones((num_features,), dtype)
        self.bias = jnp.zeros((num_features,), dtype)
        self.mean = jnp.zeros((num_features,), dtype)
        self.var = jnp.ones((num_features,), dtype)
        self.momentum = momentum
        self.epsilon = epsilon

    @overload
    def __call__(
        self, x: Float[Array, "*batch num_features"], *, train: Literal[False] = False
    ) -> Float[Array, "*batch num_features"]: ...

    @overload
    def __call__(
        self, x: Float[Array, "*batch num_features"], *, train: Literal[True]
    ) -> tuple[Float[Array, "*batch num_features"], BatchNorm]: ...

    def __call__(
        self, x: Float[Array, "*batch num_features"], *, train: bool = False
    ) -> (
        Float[Array, "*batch num_features"] | tuple[Float[Array, "*batch num_features"], BatchNorm]
    ):
        """Normalises ``x`` ``[*batch, num_features]``; see the class docstring for ``train``.

        Returns ``y`` (same shape as ``x``), or with ``train=True`` the pair
        ``(y, new_bn)``.
        """
        with jax.named_scope("BatchNorm"):
            size = self.scale.shape[0]
            check_features(
                "BatchNorm", x, size, why=f"its scale is ({size},)", argument="num_features"
            )
            x = x.astype(self.scale.dtype)
            if not train:
                return self._normalise(x, self.mean, self.var)
            axes = tuple(range(x.ndim - 1))
            count = x.size // size
            if count < 2:
                raise ValueError(
                    f"BatchNorm(train=True) needs more than one value per feature to estimate "
                    f"a variance, got an input of shape {tuple(x.shape)}; use a larger batch, "
                    f"or call it without train=True to use the running statistics."
                )
            mean = jnp.mean(x, axis=axes)
            var = jnp.mean(jnp.square(x - mean), axis=axes)
            y = self._normalise(x, mean, var)
            mean, unbiased = jax.lax.stop_gradient((mean, var * (count / (count - 1))))
            m = self.momentum
            new = self.replace(
                mean=m * self.mean + (1 - m) * mean, var=m * self.var + (1 - m) * unbiased
            )
            return y, new

    def _normalise(self, x: jax.Array, mean: jax.Array, var: jax.Array) -> jax.Array:
        return (x - mean) * jax.lax.rsqrt(var + self.epsilon) * self.scale + self.bias
