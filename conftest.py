"""Strict settings shared by `tests/` and `property_tests/`: 8 simulated CPU devices, strict
dtype promotion and no key-reuse checks. Warnings are errors and jaxtyping shapes are checked by
beartype through pyproject.toml (``filterwarnings`` and ``--jaxtyping-packages``)."""

import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

import jax
import pytest

# Before any computation: the backend is created on first use.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_debug_key_reuse", False)

# `make test` runs the tests in two processes, and `make mutate` once per mutant, each in a
# fresh process: they share compiled programs through JAX's persistent cache (a program
# compiled by one worker is read by the other; tests that build equal programs under new
# functions compile them once). No size bound: with one, JAX lists the whole cache at each
# write (a run slowed by half); without one, a process may read an entry another is still
# writing, which JAX reports with a warning and compiles instead (pyproject.toml's filter).
if cache := os.environ.get("TAKTINY_TEST_COMPILATION_CACHE"):
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# The first collected module, or other node, after which JAX's backend was running (an array
# made at a module's import starts it): `make mutate` collects tests/ in a server it forks
# once per mutant, and the backend's threads would not survive the fork
# (tests/package/test_mutation.py reads this)
BACKEND_STARTED_BY = pytest.StashKey[str]()


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    from jax._src import xla_bridge  # (tests may read JAX's internals; the library may not)

    report = yield
    stash = collector.config.stash
    if BACKEND_STARTED_BY not in stash and xla_bridge._backends:
        stash[BACKEND_STARTED_BY] = collector.nodeid
    return report


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `make mutate`, run a mutant's test files cheapest first (by the times mutmut
    measured), each file's tests in pytest's order: the run stops at the first failure, and
    a mutant most tests kill then dies in the fastest file that reaches it rather than in
    whichever came first. Files stay whole so their module fixtures are built once."""
    if "__mutmut_" not in os.environ.get("MUTANT_UNDER_TEST", ""):
        return
    from mutmut.state import state  # (mutmut's measured times, loaded before it forks)

    seconds = state().duration_by_test
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    ordered = sorted(
        files.values(), key=lambda tests: sum(seconds.get(t.nodeid, 0.0) for t in tests)
    )
    items[:] = [item for tests in ordered for item in tests]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under `make mutate`, the server that forks a process per mutant has just collected
    the tests (a heap of about 700 MB: JAX, torch, transformers): freeze it, so that each
    mutant's garbage collections (pytest's own at its end among them) skip those objects
    instead of walking them all and copying every page the fork shared. They took half of
    each mutant's time."""
    if session.config.option.collectonly and "mutmut" in sys.modules:
        gc.freeze()


# A test that takes a `platform` argument runs once per platform: `cpu`, and `gpu` and
# `tpu`, which report as skipped, with the reason, on machines without such devices (the
# property suite's every property; the unit tests of what an accelerator does otherwise)
PLATFORMS = ("cpu", "gpu", "tpu")


def _has_devices(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:  # JAX raises for a platform it has no backend for
        return False


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-accelerator",
        action="store_true",
        help="refuse to start where JAX sees no TPU or GPU devices (make test-accelerator: "
        "there every [tpu] and [gpu] test would skip, and the run pass having tested none)",
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    """With ``--require-accelerator``, stops before any test where JAX sees neither a TPU
    nor a GPU, saying which JAX it is and what it sees: a run meant for an accelerator that
    found none (a JAX installed for the CPU alone, say) would skip every test of it and
    pass."""
    if not session.config.getoption("--require-accelerator"):
        return
    if any(_has_devices(platform) for platform in PLATFORMS if platform != "cpu"):
        return
    seen = sorted({device.platform for device in jax.devices()})
    raise pytest.UsageError(
        f"--require-accelerator: JAX {jax.__version__} ({os.path.dirname(jax.__file__)}) "
        f"sees no TPU or GPU devices here, only {', '.join(seen)}: every [tpu] and [gpu] "
        "test would be skipped and the run would pass having tested no accelerator. Run it "
        "with a JAX that has the accelerator's backend (pip install 'jax[tpu]', or "
        "'jax[cuda12]' for a GPU), in the host's Python, which make test-accelerator's "
        "environment sees."
    )


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
