"""Strict settings shared by `tests/` and `property_tests/`: 8 simulated CPU devices, strict
dtype promotion and no key-reuse checks. Warnings are errors and jaxtyping shapes are checked by
beartype through pyproject.toml (``filterwarnings`` and ``--jaxtyping-packages``)."""

import os

import jax
import pytest

# Before any computation: the backend is created on first use.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_debug_key_reuse", False)

# `make mutate` runs the tests once per mutant, each in a fresh process: share compiled
# programs between them through JAX's persistent cache
if cache := os.environ.get("TAKTINY_TEST_COMPILATION_CACHE"):
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# Whether collecting the tests started JAX's backend (an array made at a module's import):
# `make mutate` collects them in a server it forks once per mutant, and the backend's threads
# would not survive the fork (tests/test_mutation.py reads this)
BACKEND_STARTED_BY_COLLECTION = pytest.StashKey[bool]()


def pytest_collection_finish(session: pytest.Session) -> None:
    from jax._src import xla_bridge  # (tests may read JAX's internals; the library may not)

    session.config.stash[BACKEND_STARTED_BY_COLLECTION] = bool(xla_bridge._backends)
