"""Where the bytes of a checkpoint come from: one narrow interface, ranges of a named file.

The format layer (a header read and checked, a tensor or a block of it read, hashed and
unpacked) and the load above it ask a file for nothing else: its name, its size, the
bytes at an offset into a buffer they own, and, as a hint, the bytes they will read next;
a local file's bytes can also be mapped, read where the page cache holds them.
`OpenFile` answers for a local file held open by its descriptor, `RemoteFile`
(`_object_store`) for an object in a bucket; the readers above them do not change.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from ._waits import POLL

MAP_WINDOW = 2**30  # the bytes of a local file mapped at once (`OpenFile.mapped`)

if TYPE_CHECKING:
    from ._object_store import Url


@runtime_checkable
class Storage(Protocol):
    """A file's bytes, read by range: what every read of a checkpoint goes through."""

    large_reads: ClassVar[bool]
    """Whether one read of many bytes beats several of a few MiB (an object store's: each
    read is a request, and a large one is fetched in parallel parts)."""

    @property
    def name(self) -> Path | Url:
        """The file, named for messages."""
        ...

    @property
    def size(self) -> int:
        """Its length in bytes."""
        ...

    def read_into(self, offset: int, buffer: memoryview) -> int:
        """Reads bytes from `offset` into `buffer`; returns how many (fewer than asked at
        the end of the file, 0 past it). A call may return fewer than the buffer holds;
        the caller asks again for the rest."""
        ...

    def advise(self, offset: int, size: int) -> None:
        """Says that the `size` bytes at `offset` will be read soon (a hint: fetching them
        ahead of the read, or nothing)."""
        ...

    def mapped(self, offset: int, size: int) -> memoryview | None:
        """The `size` bytes at `offset` mapped read-only into memory, not copied (the
        mapping lasts as long as the view does), or None where the storage cannot be
        mapped (an object's, or a file on a file system that maps none). Raises
        ValueError when the file ends before them."""
        ...

    def take_mappings(self) -> list[mmap.mmap]:
        """Every mapping it holds (`mapped`'s), forgotten and handed to the caller, whose
        to unmap (``mmap.close``, which refuses while a view of it lives); later calls of
        `mapped` map again. (A loader unmaps on a thread of its own what its load mapped:
        unmapping 1 GiB of populated pages takes 35 ms on a TPU v5e's host.)"""
        ...

    def replaced(self) -> bool:
        """Whether its name now names another file than the one opened, or none."""
        ...

    def interrupt(self) -> None:
        """Stops the reads in flight, when they can be stopped (a load's error or Ctrl-C
        does not wait for them)."""
        ...

    def close(self) -> None:
        """Lets go of what it holds (a descriptor); reads after it fail."""
        ...


class OpenFile:
    """A local file held open for reading, by descriptor (``fd``), until nothing refers to
    it or :meth:`close` is called: reads through it see the file that was at ``path``
    when it was opened, whatever is renamed over ``path`` or removed afterwards (POSIX
    keeps an open file's bytes until its last descriptor is closed). A `Storage`."""

    __slots__ = ("__weakref__", "_last", "_lock", "_windows", "close", "fd", "path")
    large_reads: ClassVar[bool] = False

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        self.close = weakref.finalize(self, os.close, self.fd)  # (calling it closes, once)
        # the mappings made (`mapped`): (start, end, the mapping while a view of it lives)
        self._windows: list[tuple[int, int, weakref.ref[mmap.mmap]]] = []
        self._last: mmap.mmap | None = None  # (the latest, kept for the tensors after it)
        self._lock = threading.Lock()

    @property
    def name(self) -> Path:
        return self.path

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read_into(self, offset: int, buffer: memoryview) -> int:
        return os.preadv(self.fd, [buffer], offset)

    def advise(self, offset: int, size: int) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, offset, size, os.POSIX_FADV_WILLNEED)

    def mapped(self, offset: int, size: int) -> memoryview | None:
        """A view of a window of the file mapped once for the tensors in it: `MAP_WINDOW`
        bytes from the first tensor asked for (or as many as a larger one takes), kept
        while a view of it lives and while it is the latest. Each mapping and unmapping
        stops every thread's page faults in the process for a moment (the kernel takes
        its lock on the address space to write), so readers mapping each tensor on their
        own waited on one another: on a TPU v5e host, an FP8 load of 64 tensors ran at
        0.49x a raw pipeline mapping each, 0.71x mapping the file once (bench/FINDINGS.md
        section 14)."""
        end = offset + size
        if end > self.size:
            raise ValueError(f"{self.path}: bytes {offset}..{end} are past the file's end")
        with self._lock:
            for start, stop, ref in self._windows:
                window = ref()
                if window is not None and start <= offset and end <= stop:
                    return memoryview(window)[offset - start : end - start]
            start = offset - offset % mmap.ALLOCATIONGRANULARITY  # (a mapping starts on one)
            stop = min(max(end, start + MAP_WINDOW), self.size)
            try:
                window = mmap.mmap(self.fd, stop - start, access=mmap.ACCESS_READ, offset=start)
            except OSError:  # (a file system that cannot map files)
                return None
            live = [w for w in self._windows if w[2]() is not None]
            self._windows = [*live, (start, stop, weakref.ref(window))]
            self._last = window
        return memoryview(window)[offset - start : end - start]

    def take_mappings(self) -> list[mmap.mmap]:
        with self._lock:
            taken = [w for _, _, ref in self._windows if (w := ref()) is not None]
            self._windows, self._last = [], None
        return taken

    def replaced(self) -> bool:
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return True
        then = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino)

    def interrupt(self) -> None:
        """Nothing: a local read is short."""


def open_storage(file: Path | Url) -> Storage:
    """The storage of a local file (`OpenFile`) or of an object (`RemoteFile`), opened.
    Raises FileNotFoundError when there is none."""
    if isinstance(file, Path):
        return OpenFile(file)
    from ._object_store import RemoteFile

    return RemoteFile(file)


def read_range(storage: Storage, offset: int, count: int) -> bytes:
    """Up to `count` bytes of `storage` from `offset` (fewer at its end)."""
    buffer = bytearray(count)
    view, done = memoryview(buffer), 0
    while done < count:
        got = storage.read_into(offset + done, view[done:])
        if not got:
            break
        done += got
    return bytes(view[:done])


def stop_reads(
    storages: Iterable[Storage], futures: Iterable[concurrent.futures.Future[Any]]
) -> None:
    """Stops a load's reads after an error or Ctrl-C: drops `futures` (the readers' tasks)
    not begun, and interrupts every storage of `storages` until the tasks begun are done.
    Interrupting once is not enough: a reader may send its requests just after, and the
    reader pool's join (at the load's end or the interpreter's exit) would wait for them
    as long as a stalled store holds them."""
    storages, begun = list(storages), [f for f in futures if not f.cancel()]
    while True:
        for storage in storages:
            storage.interrupt()
        if not begun:
            return
        begun = list(concurrent.futures.wait(begun, POLL).not_done)
