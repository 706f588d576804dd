"""Hypothesis profiles and platform parametrisation of the property suite.

The strict JAX settings (8 simulated CPU devices, strict promotion) come from the repository's
root ``conftest.py``. Profiles:

- ``ci`` (the default; ``make test``): derandomized, so every run draws the same examples and a
  failure reproduces; no example database; each property runs the count written on it in
  ``examples(...)`` (see `property_tests.budget`).
- ``thorough`` (``make property``): random, ten times the examples, failures saved in the local
  ``.hypothesis`` database and replayed first on the next run.

Both print a failing example in full with the blob that reproduces it (``print_blob``).

A test that takes a ``platform`` argument runs once per platform: ``cpu``, and ``gpu`` and
``tpu``, which report as skipped, with the reason, on machines without such devices.
"""

import jax
import pytest
from hypothesis import HealthCheck, Verbosity, settings

_COMMON = dict(
    deadline=None,  # compiling and checkpointing take as long as they take
    print_blob=True,
    verbosity=Verbosity.normal,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)
settings.load_profile("ci")  # `--hypothesis-profile=...` on the command line overrides it

PLATFORMS = ("cpu", "gpu", "tpu")


def _has_devices(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:  # JAX raises for a platform it has no backend for
        return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "platform" in metafunc.fixturenames:
        params = [
            pytest.param(
                platform,
                marks=pytest.mark.skipif(
                    not _has_devices(platform), reason=f"no {platform.upper()} devices here"
                ),
            )
            for platform in PLATFORMS
        ]
        metafunc.parametrize("platform", params)
