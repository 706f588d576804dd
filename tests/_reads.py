"""Logs of a load's reads: every outermost call of Tensor's read methods (a read that
another read method makes on its behalf is part of that one), from any reader thread, and
each tensor of a `read_together` of several; and every os.preadv, the system call each
read of a file's bytes makes; and the most reads under way at once (`in_flight`)."""

import os
import threading
import time

from taktiny.io import Tensor
from taktiny.loading import _ways

METHODS = ("read", "read_into", "read_blocks", "read_transposed")


def log_reads(monkeypatch, entry):
    """Patches Tensor's read methods to append `entry(tensor, result)` to the returned list
    once per outermost call."""
    log, depth = [], threading.local()

    def logged(method):
        def call(self, *args, **kwargs):
            depth.n = getattr(depth, "n", 0) + 1
            try:
                out = method(self, *args, **kwargs)
            finally:
                depth.n -= 1
            if depth.n == 0:
                log.append(entry(self, out))
            return out

        return call

    for name in METHODS:
        monkeypatch.setattr(Tensor, name, logged(getattr(Tensor, name)))
    together = _ways.read_together  # (the load's own name for io's read_together)

    def logged_together(tensors, **kwargs):
        depth.n = getattr(depth, "n", 0) + 1
        try:
            outs = together(tensors, **kwargs)
        finally:
            depth.n -= 1
        if depth.n == 0:
            log.extend(entry(t, out) for t, out in zip(tensors, outs, strict=True))
        return outs

    monkeypatch.setattr(_ways, "read_together", logged_together)
    return log


def log_preads(monkeypatch):
    """Patches os.preadv to append (the file's path, offset, bytes read) of every call to
    the returned list."""
    log = []
    real = os.preadv

    def logged(fd, buffers, offset, *flags):
        got = real(fd, buffers, offset, *flags)
        log.append((os.readlink(f"/proc/self/fd/{fd}"), offset, got))
        return got

    monkeypatch.setattr(os, "preadv", logged)
    return log


def in_flight(monkeypatch, owner, name, seconds=0.1):
    """Patches `owner.name` (a function that reads) to take at least `seconds` a call, and
    counts the calls under way at once, from any thread: returns a list whose one entry is
    the most seen so far."""
    lock, now, most = threading.Lock(), [0], [0]
    real = getattr(owner, name)

    def slow(*args, **kwargs):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(seconds)
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(owner, name, slow)
    return most
