"""File-level helpers for the checkpoint benchmarks: durable saves, cold reads, clean-up,
and the raw disk baseline (the same bytes written and read with plain numpy file I/O)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np


def files(path: Path) -> list[Path]:
    """The files a checkpoint at `path` consists of."""
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def size(path: Path) -> int:
    """The checkpoint's bytes on disk."""
    return sum(f.stat().st_size for f in files(path))


def sync(path: Path) -> None:
    """fsyncs every file of the checkpoint: the save is durable once this returns."""
    for f in files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(path: Path) -> None:
    """Drops the checkpoint's pages from the page cache, so the next read comes from disk."""
    for f in files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: Path) -> None:
    """Deletes a checkpoint (a file or a directory)."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def save_raw(path: Path, leaves: list[Any]) -> None:
    """The disk baseline: the leaves' bytes back to back in one file, written by numpy."""
    with open(path, "wb") as f:
        for leaf in leaves:
            f.write(np.ascontiguousarray(leaf).data)


def read_raw(path: Path, shapes: list[Any]) -> list[np.ndarray]:
    """The disk baseline's read: the whole file in one ``read()``, then a numpy view per leaf.

    (Reading leaf by leaf into fresh ``np.empty`` buffers measured 2-4x slower here: numpy
    asks for transparent huge pages on large buffers, and faulting those in during the
    read stalls in this VM. One plain buffer is the steady best, so it is the baseline.)
    """
    with open(path, "rb", buffering=0) as f:
        data = f.read()
    out, offset = [], 0
    for s in shapes:
        dtype = np.dtype(s.dtype)
        count = int(np.prod(s.shape))
        out.append(np.frombuffer(data, dtype, count, offset).reshape(s.shape))
        offset += count * dtype.itemsize
    return out
