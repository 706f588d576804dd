"""The properties still catch the broken variants of the state walk their docstrings name.

`property_tests/mutants.py` defines the variants, each a patch of `taktiny.state._state` or
`taktiny.state._values`, and which properties are expected to catch each one. Here every pair runs
in-process, on the CPU, with the ``mutants`` profile's examples and no shrinking (the first
failure is enough), so a property that stops catching its variant fails the suite; and each
property's "Seen to catch" docstring names exactly the variants listed for it.
"""

from __future__ import annotations

import importlib
import re

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException

from . import mutants

PAIRS = [(variant, test) for variant, tests in mutants.EXPECTED.items() for test in tests]


def _property(test: str):
    module, name = test.split("::")
    return getattr(importlib.import_module(f"property_tests.{module[:-3]}"), name)


@pytest.mark.parametrize(
    ("variant", "test"), PAIRS, ids=[f"{v}-{t.split('::')[1]}" for v, t in PAIRS]
)
def test_each_property_catches_its_variants(variant, test, monkeypatch):
    for module, attribute, value in mutants._mutants()[variant]:
        monkeypatch.setattr(module, attribute, value)
    inner = _property(test).hypothesis.inner_test
    quick = settings(
        max_examples=100,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    run = given(data=st.data())(quick(lambda platform, data: inner(platform=platform, data=data)))
    try:
        run(platform="cpu")
    except HypothesisException:
        raise  # Hypothesis could not run the property: that is not a catch
    except BaseException:  # noqa: BLE001 - the property failed: it caught the variant
        return
    pytest.fail(f"{test} no longer catches the variant {variant!r}")


def test_docstrings_name_exactly_the_variants_that_are_checked():
    for test in sorted({t for _, t in PAIRS} | set(_documented())):
        named = (
            set(re.findall(r"``(\w+)``", _property(test).__doc__ or "")) & mutants.EXPECTED.keys()
        )
        checked = {variant for variant, t in PAIRS if t == test}
        assert named == checked, (
            f"{test}: docstring names {sorted(named)}, checked {sorted(checked)}"
        )


def _documented() -> list[str]:
    """Every property whose docstring has a "Seen to catch" paragraph."""
    from pathlib import Path

    found = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        module = importlib.import_module(f"property_tests.{path.stem}")
        for name in dir(module):
            if name.startswith("test_") and "Seen to catch" in (
                getattr(module, name).__doc__ or ""
            ):
                found.append(f"{path.name}::{name}")
    return found
