"""Saves that go on in the background (``save_safetensors(..., wait=False)``): one thread
per save, at most one save per path at a time, and no failure left unsaid.

The caller prepares a save and hands over two things: a function that makes its files
(each file's tensors, host copies the caller made, and header metadata; the checksums are
computed by the writer, here, off the caller's thread) and a commit, the object that
writes the files and commits them in one step: ``save(files)`` returns what it wrote,
and ``warnings`` lists what went wrong after the commit. `_save._Commit` commits to a
local folder; any object with the same two members (a commit to an object store, say)
goes through the same machinery unchanged.

Rules:

- **One save per path.** A save to a path, in the background or not, first waits for the
  save in flight to it in this process (`_turn`). Saves to different paths run at once;
  within one folder their commits still take turns on the folder's lock (`_save._locked`).
- **No silent failure.** A background save's error goes to whoever calls its
  `BackgroundSave.result`. If nobody has when the next save to the same path begins, that
  save raises it, with a note naming the failed save, and does not start. If nobody ever
  does, the interpreter's exit reports it: the save threads are not daemons, so the
  interpreter waits for them before it runs its ``atexit`` handlers; then `_at_exit`
  (registered when the first background save starts) writes each unreported failure to
  stderr and ends the process with status 1.
- **Why ``os._exit``.** An ``atexit`` handler cannot change the exit status by raising:
  CPython prints the exception and exits as it would have (``SystemExit`` too is ignored
  there). ``os._exit(1)`` is the one way to exit non-zero from it; it skips what would
  have run after it, so the handler first flushes stdout and stderr and shuts logging
  down (the handlers that matter at exit), and it exits only when a save failed. Being
  registered late, it runs before the handlers registered earlier (JAX's among them),
  which a failing process does without.

A process forked while a save runs has none of its threads: the child forgets the saves
(`os.register_at_fork`) rather than wait for threads it does not have.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from ._object_store import Url

Files = list[tuple[dict[str, Any], dict[str, str]]]
"""What a commit saves: each file's tensors (host arrays the save owns; for a save that
waits, JAX arrays too, read as they are written: `_write`) and its header metadata."""

T = TypeVar("T")  # what a commit gives for each file it wrote (a local Path, say)


@runtime_checkable
class Commit(Protocol[T]):
    """Writes a save's files and commits them in one step (`_save._Commit`, for a folder)."""

    @property
    def warnings(self) -> list[str]:
        """What went wrong after the commit (the save has happened), for the caller."""
        ...

    def save(self, files: Files) -> list[T]:
        """Writes and commits `files`; returns what it wrote, in order."""
        ...


class BackgroundSave(Generic[T]):
    """A save going on in the background: what ``save_safetensors(path, tree, wait=False)``
    returns once it has copied the arrays to host memory. The files are written and
    committed by a thread of the save's own, with the same guarantees as a save that waits
    (at every instant `path` holds the previous checkpoint or the new one, whole).

    Its error is never lost: `result` raises it; if nobody has called `result` when the
    next save to the same path begins, that save raises it instead (and does not start);
    if nobody ever does, the interpreter's exit waits for the save, writes the error to
    stderr and makes the process exit with status 1. Warnings the save gives after its
    commit (it is saved, but its folder could not be flushed, say) come the same way,
    from `result` or the next save to the path, or on stderr at exit (without changing
    the exit status).

    Attributes:
        path: the checkpoint's path, as given to `save_safetensors`.
    """

    def __init__(
        self, path: Path | Url, files: Callable[[], Files] | None, commit: Commit[T] | None
    ):
        """Made by `save_safetensors`, not by hand.

        Args:
            path: the checkpoint's path.
            files: makes the files to save (None for a save that waits: it runs them itself).
            commit: writes and commits them.
        """
        self.path = path
        self._files, self._commit = files, commit
        self._finished = threading.Event()
        self._written: list[T] = []
        self._error: BaseException | None = None
        self._warnings: list[str] = []
        self._reported = False  # whether its outcome (error, warnings) reached anyone

    def result(self, timeout: float | int | None = None) -> list[T]:
        """Waits for the save to end, and gives what it wrote.

        Args:
            timeout: the most seconds to wait; None waits until the save ends.

        Returns:
            The files written: the shards, then the index; or the one file.

        Raises:
            TimeoutError: the save is still running after `timeout` seconds (it goes on;
                call `result` again).
            BaseException: the save's own error, the very exception that stopped it (an
                ``OSError`` with ``errno.ENOSPC`` for a full disk, say), at every call.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(
                f"save_safetensors: the background save to {self.path} is still running after "
                f"{timeout} s; call result() again to wait longer (result() without a timeout "
                f"waits until it ends)"
            )
        _, messages = self._report()
        for message in messages:
            warnings.warn(message, stacklevel=2)
        if self._error is not None:
            raise self._error
        return self._written

    def done(self) -> bool:
        """Whether the save has ended, saved or failed (`result` then returns at once).

        Returns:
            True once the save has ended.
        """
        return self._finished.is_set()

    def __repr__(self) -> str:
        if not self._finished.is_set():
            state = "running"
        elif self._error is not None:
            state = f"failed: {type(self._error).__name__}: {self._error}"
        else:
            state = f"saved, {len(self._written)} file{'s' * (len(self._written) != 1)}"
        return f"{type(self).__name__}({str(self.path)!r}, {state})"

    def _run(self) -> None:
        """Writes and commits the files (on the save's own thread)."""
        files, self._files = self._files, None  # (the host copies go when the save ends)
        try:
            assert files is not None and self._commit is not None
            self._written = self._commit.save(files())
            self._warnings = list(self._commit.warnings)
        except BaseException as error:  # noqa: BLE001 - reported by result(), or later
            self._error = error
            _forget_locals(error)  # (its frames would keep the host copies until reported)
        finally:
            del files
            self._finished.set()

    def _report(self) -> tuple[BaseException | None, list[str]]:
        """The error and warnings of the ended save that nobody has been given yet; from now
        on, they have been."""
        with _lock:
            if self._reported:
                return None, []
            self._reported = True
            return self._error, self._warnings


_lock = threading.Lock()
_saves: dict[Path | Url, BackgroundSave[Any]] = {}  # by path: the last save to it, until reported
_exit_registered = False


def start(path: Path | Url, files: Callable[[], Files], commit: Commit[T]) -> BackgroundSave[T]:
    """Starts a save in the background, once the save in flight to `path` has ended.

    Args:
        path: the checkpoint's path.
        files: makes the files to save (on the save's thread: it reads host copies only).
        commit: writes and commits them.

    Returns:
        The save, running.

    Raises:
        BaseException: the error of an earlier background save to `path` that nobody has
            been given (see `settle`).
    """
    global _exit_registered
    save = BackgroundSave(path, files, commit)
    _turn(path, save)
    with _lock:
        if not _exit_registered:
            atexit.register(_at_exit)
            _exit_registered = True
    thread = threading.Thread(target=save._run, name=f"taktiny save {path.name}", daemon=False)
    try:
        thread.start()
    except BaseException as error:  # (no thread: the save ends here, failed)
        save._error = error
        save._reported = True
        save._finished.set()
        raise
    return save


@contextlib.contextmanager
def waiting(path: Path | Url) -> Iterator[None]:
    """Holds `path` for a save that runs on the caller's thread: saves to it begun
    meanwhile wait until it ends.

    Args:
        path: the checkpoint's path.

    Raises:
        BaseException: the error of an earlier background save to `path` that nobody has
            been given (see `settle`).
    """
    save: BackgroundSave[Any] = BackgroundSave(path, None, None)
    save._reported = True  # (its caller gets its outcome)
    _turn(path, save)
    try:
        yield
    finally:
        save._finished.set()


def settle(path: Path | Url) -> None:
    """Waits for the save in flight to `path` in this process, if any; raises the error of
    the last background save to it when it failed and nobody has been given its error
    (`result` was not called), and warns its warnings likewise.

    Args:
        path: the checkpoint's path.

    Raises:
        BaseException: that save's own error, with a note naming the save.
    """
    _turn(path, None)


def _turn(path: Path | Url, save: BackgroundSave[Any] | None) -> None:
    """Waits until no save to `path` is in flight, reports the last one's unreported
    outcome (raising its error), then holds `path` for `save` (when given)."""
    key = _key(path)
    while True:
        with _lock:
            last = _saves.get(key)
            if last is None or (last._finished.is_set() and last._reported):
                if save is not None:
                    _saves[key] = save  # (taken while the lock is held: by nobody else)
                elif last is not None:
                    del _saves[key]
                return
            running = not last._finished.is_set()
        if running:
            last._finished.wait()
            continue
        error, messages = last._report()  # (one caller gets them; the others go on)
        for message in messages:
            warnings.warn(message, stacklevel=4)
        if error is not None:
            note = (
                f"save_safetensors: the error of the background save to {last.path}, raised "
                f"by the next save to that path (which did not start) since nobody had "
                f"called that save's result(); call result() on what save_safetensors(..., "
                f"wait=False) returns to get a background save's error there"
            )
            if note not in getattr(error, "__notes__", ()):
                error.add_note(note)
            raise error


def _forget_locals(error: BaseException) -> None:
    """Clears the local variables of the frames `error` and the errors it chains passed
    through (the traceback still shows where they were raised)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        each = todo.pop()
        if each is None or id(each) in seen:
            continue
        seen.add(id(each))
        traceback.clear_frames(each.__traceback__)
        todo += [each.__cause__, each.__context__]


def _key(path: Path | Url) -> Path | Url:
    """One name for each path: its folder's real path, and its own name (a URL: itself)."""
    if isinstance(path, Url):
        return path
    return Path(os.path.realpath(path.parent)) / path.name


def _at_exit() -> None:
    """At the interpreter's exit: waits for the saves still running, then writes each
    unreported failure (and warning) to stderr; after a failure, ends the process with
    status 1 (`os._exit`: raising here would not change the status)."""
    failed = False
    try:
        with _lock:
            saves = list(_saves.values())
        for save in saves:
            save._finished.wait()
        for save in saves:
            error, messages = save._report()
            for message in messages:
                sys.stderr.write(f"taktiny.io: warning: {message}\n")
            if error is not None:
                failed = True
                text = "".join(traceback.format_exception(error))
                sys.stderr.write(
                    f"taktiny.io: warning: the background save to {save.path} failed, and "
                    f"nobody asked for its result(): {type(error).__name__}: {error}\n"
                    f"(the process exits with status 1)\n{text}"
                )
    finally:
        if failed:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            with contextlib.suppress(Exception):
                import logging

                logging.shutdown()
            os._exit(1)


def _forget() -> None:
    """In a forked child: the parent's save threads are not there; nothing to wait for."""
    global _lock, _saves
    _lock = threading.Lock()
    _saves = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
