"""Fixtures of the unit tests. The strict JAX settings they run under live in the repository's
root ``conftest.py``, shared with ``property_tests/``."""

import os
import subprocess

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
def flattens(monkeypatch):
    """Counts the flattens of a tree: ``calls = flattens(tree)`` appends to ``calls`` the
    name of each function of ``jax.tree_util`` or ``jax.tree`` that walks a tree (flatten,
    leaves, structure, map) called with `tree` itself, until the test ends."""
    calls = []
    watched = []
    names = ("flatten", "flatten_with_path", "leaves", "structure", "map", "map_with_path")
    for module, prefix in ((jax.tree_util, "tree_"), (jax.tree, "")):
        for name in names:
            real = getattr(module, prefix + name)

            def counted(*args, _real=real, _name=prefix + name, **kwargs):
                if any(a is t for a in args for t in watched):
                    calls.append(_name)
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, prefix + name, counted)

    def watch(tree):
        watched.append(tree)
        return calls

    return watch


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


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1, one per test process (tests/_s3.py); skipped, with
    the reason, on a host that opens no TCP connection (tests/_loopback.py)."""
    import _loopback
    from _s3 import Server

    _loopback.needed()
    server = Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A new empty bucket's URL (``s3://b-...``), the environment pointing obstore (here and
    in subprocesses) at the test server."""
    for key, value in s3_server.environment().items():
        monkeypatch.setenv(key, value)
    return f"s3://{s3_server.bucket()}"


@pytest.fixture
def s3_proxy(s3_server, monkeypatch):
    """A bucket reached through a fault-injecting proxy (tests/_s3.py `Proxy`): the bucket's
    URL and the proxy."""
    from _s3 import Proxy

    proxy = Proxy(s3_server.url)
    for key, value in s3_server.environment(proxy.url).items():
        monkeypatch.setenv(key, value)
    try:
        yield f"s3://{s3_server.bucket()}", proxy
    finally:
        proxy.stop()


@pytest.fixture
def small_disk(tmp_path):
    """A folder on a file system of 1 MiB (a tmpfs; mounting one needs root, which the
    tests have: elsewhere the tests with injected faults cover the same)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the tests with injected faults cover it")
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    assert mounted.returncode == 0, mounted.stderr
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)
