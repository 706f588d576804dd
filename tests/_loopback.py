"""Whether this host opens TCP connections on 127.0.0.1. The lent TPU machine opens none,
not even there (../shared/tpu.md): the tests that need a local server (object storage's
S3 server, the bench's S3 stub) or a distributed job (``jax.distributed`` on a local
coordinator) skip there, saying why; every other host, CI's included, runs them."""

import functools
import socket

import pytest

REASON = (
    "this host opens no TCP connection, not even on 127.0.0.1 (as the lent TPU machine): "
    "local servers and distributed jobs are tested on hosts that open them (CI's)"
)


@functools.cache
def opens() -> bool:
    """Whether a TCP connection to a listening socket on 127.0.0.1 opens."""
    try:
        with socket.socket() as server, socket.socket() as client:
            server.bind(("127.0.0.1", 0))
            server.listen()
            client.settimeout(5)
            client.connect(server.getsockname())
        return True
    except OSError:
        return False


def needed() -> None:
    """Skips the calling test (with `REASON`) on a host that opens no TCP connection."""
    if not opens():
        pytest.skip(REASON)
