"""How many of a load's steps are read at once, learned from what the file system delivers,
and how far ahead of them the OS is asked to read (`Readahead`).

A disk, an NVMe drive, a network file system and the page cache each want a different
number of reads in flight: one sequential reader leaves most of a parallel store idle,
and on two cores more readers than cores only queue for them. `Readers` starts with two,
measures the bytes read per second over each window of the load, doubles the count while
a doubling pays (at least 10% more), and goes back to the last count that paid when one
does not. The read-ahead asked of the OS follows the measured rate: a quarter of a second
of reading ahead.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..io import Storage, Tensor, Url, open_storage

START = 2  # the readers a load starts with (one that copies mapped pages: `_ways.MAPPED_START`)
WINDOW = 128 * 2**20  # bytes read between two measurements
GAIN = 1.1  # a doubling of the readers must read this much faster to stay
AHEAD_S = 0.25  # seconds of reading the read-ahead keeps requested
AHEAD_LIMITS = (32 * 2**20, 1024 * 2**20)  # the read-ahead's bounds, in bytes
POOL_MOST = 64  # the reader threads a process keeps at most (`reader_pool`)


def reader_pool() -> ThreadPoolExecutor:
    """The threads that every load of the process reads with: started when a load first
    needs more than are idle, and kept for the loads after it (up to `POOL_MOST`; loads
    running at once beyond that take turns: a read waits only for reads already running,
    for a ring buffer, so every read ends). A load waits for its own tasks, never for the
    pool's end. On a TPU v5e host, starting a thread took 4-7 ms while the load's readers
    ran, 55 ms of a 108 ms FP8 load; loads with their threads kept were 1.09-1.17x as fast
    (bench/FINDINGS.md section 14). A forked child starts a pool of its own (the parent's
    threads are not in it)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(POOL_MOST, thread_name_prefix="taktiny-read")
        return _pool


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:  # (in a forked child)
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


class Readers:
    """The number of steps a load reads at once (``width``), and how far ahead it asks the
    OS to read (``ahead``), adapted to the rate at which the steps finish.

    Args:
        most: the most readers ever used.
        window: the bytes finished between two measurements.
        start: the readers it starts with.
    """

    def __init__(self, most: int = 16, window: int = WINDOW, start: int = START):
        self.most, self.window = most, window
        self.width = min(start, most)
        self.ahead = 256 * 2**20
        self.rates: dict[int, float] = {}  # width -> bytes per second measured with it
        self.settled = False
        self._bytes, self._since = 0, time.perf_counter()

    def finished(self, nbytes: int) -> None:
        """Counts `nbytes` of a step just finished; at each window's end, measures the rate
        and decides the width and read-ahead for the next."""
        self._bytes += nbytes
        if self._bytes < self.window:
            return
        now = time.perf_counter()
        rate = self._bytes / max(now - self._since, 1e-9)
        self._bytes, self._since = 0, now
        self.ahead = int(min(max(rate * AHEAD_S, AHEAD_LIMITS[0]), AHEAD_LIMITS[1]))
        self.rates[self.width] = rate
        if self.settled:
            return
        half = self.rates.get(self.width // 2)
        if half is not None and rate < GAIN * half:  # the last doubling did not pay
            self.width //= 2
            self.settled = True
        elif self.width * 2 <= self.most:
            self.width *= 2
        else:
            self.settled = True

    def __repr__(self) -> str:
        rates = ", ".join(f"{w}: {r / 1e9:.2f} GB/s" for w, r in sorted(self.rates.items()))
        return f"Readers(width={self.width}, settled={self.settled}, rates={{{rates}}})"


class Readahead:
    """Keeps the OS reading `window` bytes ahead of a reader that goes through `tensors` in
    this order, so the disk works while the reader copies and places: each call to
    :meth:`reached` (with the index of the tensor about to be read) claims the bytes up to
    `window` past it, never twice, and hands them to a thread of the read-ahead's own
    (``requests``, a queue), which asks its storage for them (``advise``:
    ``posix_fadvise(WILLNEED)`` for a local file) in `chunk`-byte requests (Linux cuts
    each request to the disk's readahead size, a few MiB at most). A reader so never waits
    for the requests: on a TPU v5e host each took about 0.2 ms, and readers that made
    their own spent 110 ms of a 130 ms load making them (bench/FINDINGS.md section 14).
    Several readers may call it at once; the loader sets `window` as it learns how fast
    the file is read. A request the storage refuses (an ``OSError``) ends the read-ahead:
    it is a hint. Leaving the context makes the requests claimed so far, then stops."""

    def __init__(self, tensors: Sequence[Tensor], window: int = 256 * 2**20, chunk: int = 2**20):
        self.tensors, self.window, self.chunk = tensors, window, chunk
        self.starts = list(itertools.accumulate((t.nbytes for t in tensors), initial=0))
        self.next, self.done = 0, 0  # the tensor being requested, and its bytes requested
        self.opened: dict[Path | Url, Storage] = {}  # the files of tensors made by hand
        self.lock = threading.Lock()
        self.requests: queue.Queue[list[tuple[Storage, int, int]] | None] = queue.Queue()
        # (a thread of its own, not the reader pool's: a task that waited for the load's
        # end in the pool could hold its last thread while the load's reads queued for it)
        self._thread = threading.Thread(target=self._advise, name="taktiny-readahead", daemon=True)
        self._thread.start()

    def reached(self, index: int) -> None:
        with self.lock:
            requests = self._requests(index)
        if requests:
            self.requests.put(requests)

    def _advise(self) -> None:
        """The read-ahead's thread: makes the requests handed to it, in turn, until None."""
        refused = False
        while (requests := self.requests.get()) is not None:
            try:
                for storage, offset, size in [] if refused else requests:
                    storage.advise(offset, size)
            except OSError:  # (a hint: the reads go on without it)
                refused = True
            finally:
                self.requests.task_done()
        self.requests.task_done()

    def _requests(self, index: int) -> list[tuple[Storage, int, int]]:
        """The requests not made yet up to `window` bytes past the tensor `index`, claimed."""
        if self.next < index:  # the reader overtook the requests
            self.next, self.done = index, 0
        k, requests = self.next, []
        while (
            k < len(self.tensors) and self.starts[k] + self.done - self.starts[index] < self.window
        ):
            tensor = self.tensors[k]
            step = min(self.chunk, tensor.nbytes - self.done)
            if step:
                storage = tensor.storage or self.opened.get(tensor.file)
                if storage is None:  # (a tensor made by hand: its file opened once, here)
                    storage = self.opened[tensor.file] = open_storage(tensor.file)
                requests.append((storage, tensor.offset + self.done, step))
            self.done += step
            if self.done >= tensor.nbytes:
                k, self.done = k + 1, 0
        self.next = k
        return requests

    def __enter__(self) -> Readahead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.requests.put(None)
        self._thread.join()
        for opened in self.opened.values():
            opened.close()
