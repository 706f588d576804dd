"""`RotaryEmbedding`: rotary position embeddings (RoPE) in the Llama / Hugging Face layout."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..module import Module


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


# Hugging Face's scaled rotary embeddings (`rope_parameters` in transformers 5, `rope_scaling`
# in 4): rope_type -> (the parameters it needs, those it may take)
SCALINGS = {
    "linear": (("factor",), ()),
    "dynamic": (("factor", "max_position_embeddings"), ()),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        (),
    ),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
}
_IGNORED = ("rope_type", "type", "rope_theta")  # the kind itself, and theta (given apart)


def _scaling(scaling: Mapping[str, Any] | None, theta: float) -> tuple[tuple[str, Any], ...]:
    """`scaling` checked, as sorted (name, value) pairs with its kind under "rope_type";
    () for plain rotary embeddings. A ValueError names every problem."""
    if scaling is None:
        return ()
    if not isinstance(scaling, Mapping):
        raise ValueError(
            f"RotaryEmbedding's scaling is a dict as Hugging Face's rope_parameters (or "
            f"rope_scaling) holds it, such as {{'rope_type': 'linear', 'factor': 4.0}}, got "
            f"{scaling!r}."
        )
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in (*SCALINGS, "default"):
        raise ValueError(
            f"RotaryEmbedding's scaling has rope_type {kind!r}; the kinds it computes are "
            f"{['default', *SCALINGS]}."
        )
    needed, optional = SCALINGS.get(kind, ((), ()))
    given = {k: v for k, v in scaling.items() if k not in _IGNORED}
    lacking = [k for k in needed if given.get(k) is None]
    unknown = sorted(set(given) - {*needed, *optional, "partial_rotary_factor"})
    problems = []
    if lacking:
        problems.append(f"it lacks {lacking}")
    if unknown:
        problems.append(f"{unknown} are not among its parameters {[*needed, *optional]}")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append("a partial_rotary_factor other than 1.0 is not supported")
    if "rope_theta" in scaling and float(scaling["rope_theta"]) != theta:
        problems.append(f"its rope_theta {scaling['rope_theta']!r} is not theta ({theta!r})")
    if given.get("factor") is not None and not float(given["factor"]) >= 1.0:
        problems.append(f"its factor must be at least 1, got {given['factor']!r}")
    if problems:
        raise ValueError(
            f"RotaryEmbedding's {kind!r} scaling {dict(scaling)!r}: {'; '.join(problems)}."
        )
    given.pop("partial_rotary_factor", None)
    if kind == "default":
        return ()
    return (("rope_type", kind), *sorted((k, v) for k, v in given.items() if v is not None))


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

    ``scaling`` stretches the frequencies for contexts longer than the model was trained
    on, as Hugging Face's ``rope_parameters`` (``rope_scaling`` in transformers 4) says,
    computed as transformers computes them:

    - ``{"rope_type": "linear", "factor": f}``: every frequency divided by ``f``.
    - ``{"rope_type": "dynamic", "factor": f, "max_position_embeddings": n}`` (NTK): for a
      call over ``length`` tokens, theta grows to ``theta * (f * L / n - (f - 1)) **
      (head_dim / (head_dim - 2))`` with ``L = max(length, n)``. Hugging Face takes ``L``
      from the largest position id it is given; here it is the call's static length,
      which is the same for a forward over positions ``0 .. length - 1`` (with a cache,
      each call's keys keep the frequencies of their own call).
    - ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
      "original_max_position_embeddings"}``: Llama 3.1's, long wavelengths divided by
      ``factor``, short ones kept, the ones between interpolated.
    - ``{"rope_type": "yarn", "factor", "original_max_position_embeddings"}``, and
      optionally ``attention_factor``, ``beta_fast``, ``beta_slow``, ``mscale``,
      ``mscale_all_dim``, ``truncate``: YaRN's blend of both, with the cosines and sines
      scaled by its attention factor.

    A ``rope_theta`` in the dict must equal ``theta``; ``"default"`` means no scaling.

    No parameters: the state is empty; ``head_dim``, ``theta`` and ``scaling`` are
    configuration.

    Args:
        head_dim: the number of features of each head (even).
        theta: the base of the frequencies (Llama 2: 10000, Llama 3: 500000).
        scaling: Hugging Face's scaled-rotary parameters, a dict; None for none.

    Raises:
        ValueError: `head_dim` is odd or less than 2, `theta` is not positive, or
            `scaling` is not a dict of a known kind with the parameters it needs.
    """

    head_dim: int
    theta: float
    scaling: tuple[tuple[str, Any], ...]

    def __init__(
        self, head_dim: int, *, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None
    ):
        if head_dim < 2 or head_dim % 2:
            raise ValueError(
                f"RotaryEmbedding's head_dim must be even and at least 2 (the features of a "
                f"head turn in pairs), got {head_dim!r}; pass the size of one head."
            )
        if not theta > 0:
            raise ValueError(f"RotaryEmbedding's theta must be positive, got {theta!r}.")
        self.head_dim = head_dim
        self.theta = float(theta)
        self.scaling = _scaling(scaling, self.theta)

    def inv_freq(self, length: int | None = None) -> Float[Array, " half"]:
        """The angle each pair of features turns by per position, computed as Hugging
        Face computes it.

        Computed in NumPy, step by step in float32 as PyTorch computes it: configuration,
        not data, so a constant of the compiled program.

        Args:
            length: the tokens of the call, which only ``"dynamic"`` scaling reads; None
                stands for its ``max_position_embeddings``.

        Returns:
            ``[head_dim // 2]``, float32.
        """
        kind, params = dict(self.scaling).get("rope_type"), dict(self.scaling)
        dim, theta = self.head_dim, self.theta
        if kind == "dynamic":
            factor, trained = float(params["factor"]), int(params["max_position_embeddings"])
            seen = max(length or trained, trained)
            theta = theta * ((factor * seen / trained) - (factor - 1)) ** (dim / (dim - 2))
        if kind == "yarn":
            return jnp.asarray(_yarn(dim, theta, params))
        inv_freq = np.float32(1.0) / _powers(theta, dim)
        if kind == "linear":
            inv_freq = inv_freq / np.float32(params["factor"])
        elif kind == "llama3":
            inv_freq = _llama3(inv_freq, params)
        return jnp.asarray(inv_freq)

    @property
    def attention_factor(self) -> float:
        """What the cosines and sines are multiplied by: YaRN's attention factor, else 1."""
        params = dict(self.scaling)
        return _yarn_attention(params) if params.get("rope_type") == "yarn" else 1.0

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

        Raises:
            ValueError: `x` has fewer than three axes or a last axis other than
                ``head_dim``, or `positions` does not broadcast to ``[*batch, length]``.
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
            angles = positions.astype(jnp.float32)[..., None] * self.inv_freq(x.shape[-3])
            cos, sin = jnp.cos(angles), jnp.sin(angles)
            if (factor := self.attention_factor) != 1.0:
                cos, sin = cos * jnp.float32(factor), sin * jnp.float32(factor)
            cos = cos[..., None, :].astype(work)  # [*batch, length, 1, half]
            sin = sin[..., None, :].astype(work)
            half = self.head_dim // 2
            x1, x2 = x[..., :half].astype(work), x[..., half:].astype(work)
            rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
            return rotated.astype(x.dtype)


def _powers(theta: float, dim: int) -> np.ndarray:
    """``theta ** (arange(0, dim, 2) / dim)`` in float32 as PyTorch computes it: the
    exponents in float32, each power rounded to float32 from float64, as the C library's
    ``powf`` that PyTorch calls gives it. (NumPy 2.4.6's own float32 power is an ulp off
    for some exponents; at position 2,000 that moves an angle by 1e-4.)"""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return (np.float64(np.float32(theta)) ** exponents.astype(np.float64)).astype(np.float32)


def _llama3(inv_freq: np.ndarray, params: Mapping[str, Any]) -> np.ndarray:
    """Llama 3.1's frequencies: wavelengths longer than the trained context / low_freq_factor
    divided by factor, shorter than it / high_freq_factor kept, interpolated between."""
    f32 = np.float32
    factor, low, high = (f32(params[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    context = f32(params["original_max_position_embeddings"])
    wavelen = f32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) & ~(wavelen > context / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_attention(params: Mapping[str, Any]) -> float:
    """YaRN's attention factor: given, or 0.1 ln(factor) + 1 (a ratio of two such terms
    with mscale and mscale_all_dim)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])

    def mscale(scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(float(params["mscale"])) / mscale(float(params["mscale_all_dim"]))
    return mscale()


def _yarn(dim: int, theta: float, params: Mapping[str, Any]) -> np.ndarray:
    """YaRN's frequencies: interpolated (divided by factor) for the dimensions that turn
    fewer than beta_slow times over the trained context, kept for those that turn more
    than beta_fast times, a linear ramp between."""
    f32 = np.float32
    factor, context = float(params["factor"]), float(params["original_max_position_embeddings"])
    fast, slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def correction(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # (as transformers avoids a division by 0)
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
    position = _powers(theta, dim)
    keep = f32(1) - ramp  # how much of each frequency is extrapolated (kept as it is)
    interpolated, extrapolated = f32(1) / (f32(factor) * position), f32(1) / position
    return (interpolated * (f32(1) - keep) + extrapolated * keep).astype(f32)
