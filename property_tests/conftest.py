"""Hypothesis profiles and platform parametrisation of the property suite.

The strict JAX settings (8 simulated CPU devices, strict promotion) come from the repository's
root ``conftest.py``. Profiles:

- ``ci`` (the default; ``make test``): derandomized, so every run draws the same examples and a
  failure reproduces; no example database; each property runs the count written on it in
  ``examples(...)`` (see `property_tests.budget`).
- ``thorough`` (``make property``): random, ten times the examples, failures saved in the local
  ``.hypothesis`` database and replayed first on the next run.
- ``accelerator`` (``make test-accelerator``): as ``ci`` with half the examples, and a failure
  reported as found, not shrunk.

All print a failing example in full with the blob that reproduces it (``print_blob``).

A test that takes a ``platform`` argument runs once per platform: ``cpu``, and ``gpu`` and
``tpu``, which report as skipped, with the reason, on machines without such devices. On a GPU
or TPU an example's arrays take a few fixed shapes and dtypes (`property_tests.arrays`), so
that it runs programs earlier examples compiled.
"""

from collections.abc import Iterator

import jax
import pytest
from hypothesis import HealthCheck, Phase, Verbosity, settings

_COMMON = dict(
    deadline=None,  # compiling and checkpointing take as long as they take
    print_blob=True,
    verbosity=Verbosity.normal,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **_COMMON)
settings.register_profile("thorough", max_examples=1000, **_COMMON)
# on an accelerator: as `ci`, but a failure is reported as found, not shrunk (each example
# shrinking tries compiles new programs, seconds each on a TPU, under Hypothesis's tracing);
# and half the examples: on a TPU an example also costs its transfers to and from the chip
# and a jitted property's compiles, which no reuse saves (`ci` on the CPU keeps the variety)
settings.register_profile(
    "accelerator",
    max_examples=50,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    **_COMMON,
)
settings.load_profile("ci")  # `--hypothesis-profile=...` on the command line overrides it

PLATFORMS = ("cpu", "gpu", "tpu")


def _has_devices(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:  # JAX raises for a platform it has no backend for
        return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "platform" in metafunc.fixturenames:
        metafunc.parametrize("platform", PLATFORMS)


@pytest.fixture(autouse=True)
def _on_platform(request: pytest.FixtureRequest) -> Iterator[None]:
    """Skips a platform's run where it has no devices: asked as the test runs, not as it
    is collected, because asking starts JAX's backend (which `make mutate`'s fork server
    must not have started; tests/package/test_mutation.py checks it). Runs it with the
    platform's first device as JAX's default device: on an accelerator host whose default
    is the CPU (``make test-accelerator``), the arrays a test makes without placing them
    are the platform's, as a user's on that platform are."""
    callspec = getattr(request.node, "callspec", None)
    platform = callspec.params.get("platform") if callspec is not None else None
    if platform is None:
        yield
        return
    if not _has_devices(platform):
        pytest.skip(f"no {platform.upper()} devices here")
    with jax.default_device(jax.devices(platform)[0]):
        yield
