"""`Embed`: a lookup table from integer ids to vectors, usable as a tied output projection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Integer

from ..arrays import Spec
from ..module import Module, Rngs
from ._explicit import explicit_axes, free, project, typed_spec
from ._layer_checks import check_features, check_ids
from ._precision import DTYPE, PRECISION, compute_dtype, static_dtype, static_precision
from ._random import normal


class Embed(Module):
    """A table of ``num_embeddings`` vectors of size ``features``, looked up by integer id.

    Attributes:
        embedding: ``[num_embeddings, features]``, standard-normal initialised
            (``normal(0, 1)``, as PyTorch's ``nn.Embedding``, whose ``weight`` has the same
            layout and needs no conversion).

    Args:
        num_embeddings: the number of ids (the vocabulary size).
        features: the size of each vector.
        dtype: the dtype of the vectors looked up (the rows are cast to it) and the
            dtype :meth:`attend` computes in and returns; None (the default) is the
            embedding's dtype.
        param_dtype: the dtype the embedding is created and stored in.
        precision: the precision of :meth:`attend`'s matrix product
            (``jax.lax.Precision`` or its name, ``"highest"`` for full float32 on GPUs
            and TPUs); None uses JAX's default, which is TF32 for float32 on recent
            NVIDIA GPUs. Lookups multiply nothing.
        embedding_sharding: how ``embedding`` is split over the mesh of an enclosing
            ``jax.set_mesh``: a tuple of mesh axis names, one per axis (``("model", None)``
            splits the vocabulary, ``(None, "model")`` the features), or a
            ``PartitionSpec``. Ignored without a mesh.
        rngs: the key stream for the initialisation.
    """

    embedding: Float[Array, "num_embeddings features"]
    dtype: jnp.dtype | None = DTYPE
    precision: jax.lax.PrecisionLike = PRECISION

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype: DTypeLike | None = None,
        param_dtype: DTypeLike = jnp.float32,
        precision: jax.lax.PrecisionLike = None,
        embedding_sharding: Spec | None = None,
        rngs: Rngs,
    ):
        shape, where = (num_embeddings, features), "Embed.embedding"
        self.embedding = normal(rngs(), shape, param_dtype, 1.0, embedding_sharding, where)
        self.dtype = static_dtype(dtype)
        self.precision = static_precision(precision, "Embed")

    def __call__(self, ids: Integer[Array, "*batch"]) -> Float[Array, "*batch features"]:
        """Returns the rows of ``embedding`` for `ids`, in ``dtype``.

        Ids follow NumPy's indexing: a negative id counts from the end of the table. An id
        ``>= num_embeddings`` gives a row of NaNs (not an error, so that the call works
        inside ``jax.jit``), which makes the mistake visible downstream.

        Args:
            ids: ``[*batch]``, integers.

        Returns:
            ``[*batch, features]``.

        Raises:
            TypeError: `ids` is not an integer array.
        """
        with jax.named_scope("Embed"):
            check_ids("Embed", ids)
            dtype = compute_dtype(self.dtype, self.embedding)
            if not explicit_axes():
                rows = jnp.take(self.embedding, ids, axis=0, mode="fill", fill_value=jnp.nan)
                return rows.astype(dtype)  # only the rows read are cast
            # on Explicit axes a gather from a split table must be told its output's split:
            # the ids' on the batch axes, the table's feature split on the last
            batch = typed_spec(ids)
            out = P(*batch, free(typed_spec(self.embedding)[1], *batch))
            rows = self.embedding.at[ids].get(mode="fill", fill_value=jnp.nan, out_sharding=out)
            return rows.astype(dtype)

    def attend(self, x: Float[Array, "*batch features"]) -> Float[Array, "*batch num_embeddings"]:
        """Scores `x` against every row: ``x @ embedding.T``.

        This is the output projection of a language model whose input and output
        embeddings are tied, computed in ``dtype`` at ``precision``.

        Args:
            x: ``[*batch, features]``.

        Returns:
            ``[*batch, num_embeddings]`` (logits).

        Raises:
            ValueError: the last axis of `x` does not have ``features`` entries.
        """
        with jax.named_scope("Embed.attend"):
            shape = tuple(self.embedding.shape)
            check_features(
                "Embed.attend", x, shape[1], why=f"its embedding is {shape}", argument="features"
            )
            dtype = compute_dtype(self.dtype, self.embedding)
            table = self.embedding.astype(dtype).T
            return project(x.astype(dtype), table, None, self.precision)
