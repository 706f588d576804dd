"""Strict test settings: 8 simulated CPU devices, strict dtype promotion, warnings as errors
(set in pyproject.toml), and jaxtyping shapes checked by beartype (pytest's
``--jaxtyping-packages`` option, also in pyproject.toml)."""

import jax
import pytest

# Before any computation: the backend is created on first use.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_debug_key_reuse", False)


@pytest.fixture
def optax_promotion():
    """optax's adam computes ``decay ** count`` with an int32 ``count``, which strict
    promotion rejects; tests that step optax optimisers run under standard promotion."""
    with jax.numpy_dtype_promotion("standard"):
        yield
