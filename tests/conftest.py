"""Fixtures of the unit tests. The strict JAX settings they run under live in the repository's
root ``conftest.py``, shared with ``property_tests/``."""

import jax
import pytest


@pytest.fixture
def optax_promotion():
    """optax's adam computes ``decay ** count`` with an int32 ``count``, which strict
    promotion rejects; tests that step optax optimisers run under standard promotion."""
    with jax.numpy_dtype_promotion("standard"):
        yield
