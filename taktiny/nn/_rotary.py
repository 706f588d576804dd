"""`RotaryEmbedding`: rotary position embeddings (RoPE) in the Llama / Hugging Face layout."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._module import Module


def check_positions(layer: str, positions: Any, target: tuple[int, ...], axes: str) -> jax.Array:
    """`positions` as an array, checked to be integer ids broadcastable to `target`
    (``[*batch, length]``, written `axes` in the message) with exactly ``length`` entries
    on the last axis; raises a ValueError naming `layer` otherwise."""
    positions = jnp.asarray(positions)
    shape, lead = positions.shape, target[:-1]
    ok = jnp.issubdtype(positions.dtype, jnp.integer) and 1 <= positions.ndim <= len(target)
    ok = ok and shape[-1] == target[-1]
    ok = ok and all(p in (1, t) for p, t in zip(shape[-2::-1], lead[::-1], strict=False))
    if not ok:
        raise ValueError(
            f"{layer}'s positions must be integer position ids of shape {axes} = "
            f"{list(target)} (or broadcastable to it, such as [{target[-1]}]), got "
            f"{positions.dtype}{list(shape)}. Pass one integer position per token, such as "
            f"jnp.arange({target[-1]}) + offset."
        )
    return positions


def fold_positions(
    layer: str, positions: Any, batch: tuple[int, ...], length: int, offset: Any
) -> jax.Array:
    """The position ids of `length` queries with batch axes `batch`, their batch axes
    folded into one (``[B, length]``, or ``[length]`` when shared): the checked
    `positions`, or ``arange(length)`` plus `offset` (a cache's length) when None."""
    if positions is None:
        positions = jnp.arange(length, dtype=jnp.int32)
        return positions if offset is None else offset + positions
    target = (*batch, length)
    positions = check_positions(layer, positions, target, "[*batch, q_length]")
    if positions.ndim == 1:
        return positions
    return jnp.broadcast_to(positions, target).reshape(-1, length)


class RotaryEmbedding(Module):
    """Rotary position embeddings: rotates pairs of features of each head by angles that
    grow with the token's position, so that the dot product of a rotated query and key
    depends on their relative position only.

    The convention is Llama's, as Hugging Face's ``LlamaRotaryEmbedding`` and
    ``apply_rotary_pos_emb`` ("rotate half") compute it: feature ``i`` of the first half
    of a head pairs with feature ``i`` of the second half, and turns by
    ``position * inv_freq[i]`` with ``inv_freq = 1 / theta ** (arange(0, head_dim, 2) /
    head_dim)``. Angles, cosines and sines are computed in float32 (at least), and the
    rotation too; the result is cast back to the input's dtype. (The original RoFormer /
    GPT-J layout pairs neighbouring features instead; permute the query and key
    projections' output features to use it.)

    No parameters: the state is empty, and ``head_dim`` and ``theta`` are configuration.

    Args:
        head_dim: the number of features of each head (even).
        theta: the base of the frequencies (Llama 2: 10000, Llama 3: 500000).
    """

    head_dim: int
    theta: float

    def __init__(self, head_dim: int, *, theta: float = 10000.0):
        if head_dim < 2 or head_dim % 2:
            raise ValueError(
                f"RotaryEmbedding's head_dim must be even and at least 2 (the features of a "
                f"head turn in pairs), got {head_dim!r}; pass the size of one head."
            )
        if not theta > 0:
            raise ValueError(f"RotaryEmbedding's theta must be positive, got {theta!r}.")
        self.head_dim = head_dim
        self.theta = float(theta)

    def inv_freq(self) -> Float[Array, " half"]:
        """The angle each pair of features turns by per position, ``[head_dim // 2]``
        (float32, computed as Hugging Face computes it)."""
        exponents = jnp.arange(0, self.head_dim, 2, dtype=jnp.float32) / self.head_dim
        return 1.0 / (self.theta**exponents)

    def __call__(
        self,
        x: Float[Array, "*batch length heads head_dim"],
        positions: Int[Array, "*#batch length"],
    ) -> Float[Array, "*batch length heads head_dim"]:
        """Rotates ``x`` ``[*batch, length, heads, head_dim]`` by its tokens' positions.

        Args:
            x: queries or keys split into heads, ``[*batch, length, heads, head_dim]``.
            positions: integer position ids, ``[*batch, length]`` or broadcastable to it
                (``[length]`` for every sequence of the batch alike).

        Returns:
            ``[*batch, length, heads, head_dim]``, in ``x``'s dtype.
        """
        with jax.named_scope("RotaryEmbedding"):
            if x.ndim < 3 or x.shape[-1] != self.head_dim:
                raise ValueError(
                    f"RotaryEmbedding expects x of shape [*batch, length, heads, head_dim] "
                    f"with head_dim={self.head_dim}, got {tuple(x.shape)}; build it with "
                    f"RotaryEmbedding({x.shape[-1] if x.ndim else '...'}) for these heads."
                )
            axes = "[*batch, length]"
            positions = check_positions("RotaryEmbedding", positions, x.shape[:-2], axes)
            work = x.dtype if jnp.finfo(x.dtype).bits > 32 else jnp.dtype(jnp.float32)
            angles = positions.astype(jnp.float32)[..., None] * self.inv_freq()
            cos = jnp.cos(angles)[..., None, :].astype(work)  # [*batch, length, 1, half]
            sin = jnp.sin(angles)[..., None, :].astype(work)
            half = self.head_dim // 2
            x1, x2 = x[..., :half].astype(work), x[..., half:].astype(work)
            rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
            return rotated.astype(x.dtype)
