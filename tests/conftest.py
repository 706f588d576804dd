"""Fixtures of the unit tests. The strict JAX settings they run under live in the repository's
root ``conftest.py``, shared with ``property_tests/``."""

import jax
import jaxtyping
import pytest


@pytest.fixture
def optax_promotion():
    """optax's adam computes ``decay ** count`` with an int32 ``count``, which strict
    promotion rejects; tests that step optax optimisers run under standard promotion."""
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture
def without_type_checks():
    """The tests check every annotation with beartype (through jaxtyping), which rejects an
    input that breaks a signature before Taktiny sees it. Taktiny's own checks of such
    inputs, the messages users get, are tested with those test-time checks turned off."""
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
