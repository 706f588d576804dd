"""Strict settings shared by `tests/` and `property_tests/`: 8 simulated CPU devices, strict
dtype promotion and no key-reuse checks. Warnings are errors and jaxtyping shapes are checked by
beartype through pyproject.toml (``filterwarnings`` and ``--jaxtyping-packages``)."""

import jax

# Before any computation: the backend is created on first use.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_debug_key_reuse", False)
