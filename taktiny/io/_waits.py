"""Waiting on other threads' work so that Ctrl-C stops the wait at once: the reads of a
bucket (`_object_store`) and the load's read-ahead wait through these, never in a plain
``Future.result()``."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Collection
from typing import Any, TypeVar

_T = TypeVar("_T")
POLL = 0.05  # seconds between the main thread's looks at a pending Ctrl-C while it waits


def waited(futures: Collection[concurrent.futures.Future[Any]]) -> None:
    """Returns once each of `futures` is done, or one has failed or been cancelled (the
    caller then asks each for its result); Ctrl-C stops the wait at once, whichever
    thread the signal reached.

    A process's SIGINT goes to one of its threads that does not block it: on Linux the
    main thread as a rule, but any thread may take it (POSIX leaves the choice open), and
    a process reading a bucket has many (the HTTP client's, XLA's, the readers). Python's
    handler then runs on that thread and only marks the signal for the main thread, which,
    asleep in ``Future.result()`` (a lock's wait), is not woken: it raised
    KeyboardInterrupt only when the awaited request came back, which a stalled store puts
    off by a minute or more. So the main thread waits in slices of `POLL` seconds, between
    which it runs Python, which raises the marked KeyboardInterrupt. Other threads wait
    plainly (only the main thread handles signals)."""
    main = threading.current_thread() is threading.main_thread()
    pending: Collection[concurrent.futures.Future[Any]] = futures
    while pending:
        done, pending = concurrent.futures.wait(
            pending, POLL if main else None, concurrent.futures.FIRST_EXCEPTION
        )
        if any(f.cancelled() or f.exception() is not None for f in done):
            return


def result_of(future: concurrent.futures.Future[_T]) -> _T:
    """``future.result()``, waited for as `waited` waits: Ctrl-C stops it at once."""
    waited([future])
    return future.result()
