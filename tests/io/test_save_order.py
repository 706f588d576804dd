"""The order of a save's durability steps, not only their number: every new file's data is
flushed (``fsync``) after it is written and before the rename that puts it in place; the
new files' folder is flushed before they are renamed out of it; the shards' new names are
flushed before the index that names them is committed; the commit is flushed before any
file of the previous checkpoint is removed, and the removals are flushed last.

A save's file operations are recorded at the ``os`` boundary (``open``, ``write``,
``fsync``, ``replace``, ``unlink``, and Taktiny's writer of one file, ``_write.write_file``),
each with the path it acts on, for a save in each layout of tests/_crash.py. A save that makes the same calls
in another order (an ``fsync`` after the rename it should precede, the old shards removed
before the commit is flushed) fails here though it passes every count."""

import os
from pathlib import Path

import pytest
from _crash import SCENARIOS, prepare, save, version

from taktiny.io import _write


class Recorder:
    """Records ("write" | "fsync" | "replace" | "unlink", path[, destination]) events,
    resolving file descriptors to the paths they were opened on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.events: list[tuple[str, Path] | tuple[str, Path, Path]] = []
        self.fds: dict[int, Path] = {}
        real = {n: getattr(os, n) for n in ("open", "close", "write", "fsync", "replace")}
        real_rename, real_unlink, real_save = os.rename, os.unlink, _write.write_file

        def path(p, dir_fd=None):
            p = Path(os.fsdecode(p))
            return self.fds.get(dir_fd, Path("?")) / p if dir_fd is not None else p

        def open_(p, flags, mode=0o777, *, dir_fd=None):
            fd = real["open"](p, flags, mode, dir_fd=dir_fd)
            self.fds[fd] = path(p, dir_fd)
            return fd

        def close(fd):
            self.fds.pop(fd, None)
            return real["close"](fd)

        def write(fd, data):
            self.events.append(("write", self.fds.get(fd, Path(f"?fd{fd}"))))
            return real["write"](fd, data)

        def fsync(fd):
            fd_ = fd if isinstance(fd, int) else fd.fileno()
            self.events.append(("fsync", self.fds.get(fd_, Path(f"?fd{fd_}"))))
            return real["fsync"](fd)

        def replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
            self.events.append(("replace", path(src, src_dir_fd), path(dst, dst_dir_fd)))
            return real["replace"](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

        def rename(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
            self.events.append(("replace", path(src, src_dir_fd), path(dst, dst_dir_fd)))
            return real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

        def unlink(p, *, dir_fd=None):
            self.events.append(("unlink", path(p, dir_fd)))
            return real_unlink(p, dir_fd=dir_fd)

        def write_file(tensors, filename, metadata):
            self.events.append(("write", path(filename)))
            return real_save(tensors, filename, metadata)

        for name, call in [
            ("open", open_),
            ("close", close),
            ("write", write),
            ("fsync", fsync),
            ("replace", replace),
            ("rename", rename),
            ("unlink", unlink),
        ]:
            monkeypatch.setattr(os, name, call)
        monkeypatch.setattr(_write, "write_file", write_file)

    def where(self, kind: str, *paths: Path, after: int = -1) -> list[int]:
        """The positions of the events `kind` on `paths`, after position `after`."""
        return [
            i
            for i, event in enumerate(self.events)
            if i > after and event[0] == kind and tuple(event[1 : 1 + len(paths)]) == paths
        ]

    def show(self, folder: Path) -> str:
        def short(p):
            return str(p.relative_to(folder)) if p.is_relative_to(folder) else str(p)

        return "\n".join(
            f"{i:3} {e[0]} " + " -> ".join(short(p) for p in e[1:])
            for i, e in enumerate(self.events)
        )


def check_order(rec: Recorder, folder: Path, written: list[Path], old: list[Path]) -> None:
    """Asserts the order that makes the save durable; `written` the files the save
    returned, `old` the previous checkpoint's files."""
    target, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    log = rec.show(folder)
    # the rename that put each new file in place, from its temporary
    placed: dict[Path, tuple[int, Path]] = {}
    for f in written:
        (i,) = [i for i, e in enumerate(rec.events) if e[0] == "replace" and e[2] == f] or [None]
        assert i is not None, f"{f.name} was never renamed into place\n{log}"
        placed[f] = (i, rec.events[i][1])
    # the commit: the rename over the one file, or over the index; a save of shards over
    # one file commits when that file, which shadows the index, is removed
    if index in written:
        commit = placed[index][0]
        if target in old:
            unlinked = rec.where("unlink", target)[0]  # (the later removals find none)
            synced = rec.where("fsync", folder, after=commit)
            assert synced and synced[0] < unlinked, (
                f"the new index's name must be flushed (fsync of the folder) before the old "
                f"file that shadows it is removed\n{log}"
            )
            commit = unlinked
    else:
        commit = placed[target][0]
    for f, (renamed, temp) in placed.items():
        writes, syncs = rec.where("write", temp), rec.where("fsync", temp)
        assert writes, f"{temp} was never written\n{log}"
        assert [s for s in syncs if writes[-1] < s < renamed], (
            f"{f.name}: its data must be flushed (fsync of {temp.name}) after its last write "
            f"and before its rename into place\n{log}"
        )
        assert renamed <= commit, f"{f.name} was renamed into place after the commit\n{log}"
    data = [(i, t) for f, (i, t) in placed.items() if f != index]
    staging = {t.parent for _, t in data}
    assert len(staging) == 1 and folder not in staging, log
    (staging,) = staging
    first_out = min(i for i, _ in data)
    last_sync = max(max(rec.where("fsync", t)) for _, t in data)
    assert [s for s in rec.where("fsync", staging) if last_sync < s < first_out], (
        f"the new files' folder must be flushed after their data and before they are renamed "
        f"out of it\n{log}"
    )
    if index in written:  # the shards' new names, flushed before the index names them
        last_shard = max(i for i, _ in data)
        assert [s for s in rec.where("fsync", folder) if last_shard < s < placed[index][0]], (
            f"the shards' names must be flushed (fsync of the folder) after their renames and "
            f"before the index is renamed into place\n{log}"
        )
    # after the commit: the folder flushed, and only then the old files removed
    after = rec.where("fsync", folder, after=commit)
    assert after, f"the commit must be flushed (fsync of the folder) after it\n{log}"
    removed = [i for f in old if f not in written for i in rec.where("unlink", f) if i != commit]
    for i in removed:
        assert i > after[0], (
            f"{rec.events[i][1].name} of the previous checkpoint was removed before the "
            f"commit was flushed\n{log}"
        )
    if removed:
        assert [s for s in after if s > max(removed)], (
            f"the removals must be flushed (fsync of the folder) after them\n{log}"
        )


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_save_flushes_its_files_before_the_commit_and_the_folder_after(
    tmp_path, monkeypatch, scenario
):
    old_layout, limit = SCENARIOS[scenario]
    prepare(tmp_path, old_layout)
    old = sorted(p for p in tmp_path.iterdir() if p.name != "notes.txt")
    assert (old != []) == (old_layout != "none")
    rec = Recorder(monkeypatch)
    written = save(tmp_path, version(2), limit)
    monkeypatch.undo()
    assert (len(written) == 1) == (limit is None)  # one file, or shards and an index
    check_order(rec, tmp_path, written, old)
    removed = {e[1] for e in rec.events if e[0] == "unlink"}
    if scenario in ("shards over shards", "fewer shards over shards", "single over shards"):
        assert set(old) - set(written) <= removed  # (the order of these removals is checked)


def test_the_checks_see_a_flush_moved_after_the_rename(tmp_path, monkeypatch):
    """The recorder itself: a log in which a file's fsync comes after its rename, or the
    old shards go before the commit is flushed, is refused."""
    prepare(tmp_path, 25_000)
    old = sorted(p for p in tmp_path.iterdir() if p.name != "notes.txt")
    rec = Recorder(monkeypatch)
    written = save(tmp_path, version(2), 25_000)
    monkeypatch.undo()
    check_order(rec, tmp_path, written, old)
    events = list(rec.events)
    # a shard's data flushed only after its rename
    (first,) = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == written[0]]
    temp = events[first][1]
    moved = [e for e in events if e != ("fsync", temp)]
    moved.insert(moved.index(events[first]) + 1, ("fsync", temp))
    rec.events = moved
    with pytest.raises(AssertionError, match=r"its data must be flushed .* before its rename"):
        check_order(rec, tmp_path, written, old)
    # an old shard removed before the folder is flushed after the commit
    (commit,) = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == written[-1]]
    early = events[:]
    unlink = next(e for e in events if e[0] == "unlink" and e[1] in old)
    early.remove(unlink)
    early.insert(commit + 1, unlink)
    rec.events = early
    with pytest.raises(AssertionError, match=r"removed before the commit was flushed"):
        check_order(rec, tmp_path, written, old)
