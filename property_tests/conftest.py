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

Each property takes a ``platform`` argument and runs once per platform (the root
``conftest.py`` parametrises it, for the unit tests too). On a GPU or TPU an example's arrays
take a few fixed shapes and dtypes (`property_tests.arrays`), so that it runs programs
earlier examples compiled.
"""

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
