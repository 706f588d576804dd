"""A save to object storage, committed without a rename: the object store's counterpart of
`_save._Commit`.

An object store has no rename and no directory to flush, but a ``PUT`` of one object (a
multipart upload too, at its completion) replaces it whole, in one step every reader
sees at once. So a save writes what no reader reads yet, then commits with one request:

1. it removes what earlier saves left when they failed or were killed (shards that
   neither the committed index nor the record names, copies the record does not name, an
   index that a committed single object shadows);
2. each new shard goes up under a name unique to the save
   (``model-00001-of-00003-1a2b3c4d.safetensors``), large ones in parallel parts;
3. it keeps the committed checkpoint for its readers (`ObjectCommit._keep`): its shards
   as they are, its single object copied within the store to `previous_copy`'s name; the
   record ``.model.safetensors.previous.json`` names them;
4. one request commits: the ``PUT`` of the single object; for shards, the ``PUT`` of the
   index, or, when the path held one object, that object's removal (it shadows the
   index, as on disk);
5. the objects that the save before kept are removed.

A reader that opened the previous checkpoint reads its objects by their ETags; an object
written over or removed fails the ETag, and the reads go on from the kept copy
(`_object_store.RemoteFile`). Once the next save has removed the kept objects too, its
reads fail with `Replaced`, and a load opens the checkpoint again.

A process killed during a multipart upload leaves the upload's parts on the server,
invisible to listings. obstore 0.12 can neither list nor abort such uploads, so step 1
does it for an ``s3://`` URL through boto3 (part of the ``taktiny[cloud]`` extra, imported
only then): the incomplete uploads of this checkpoint's names are aborted. Elsewhere a
bucket lifecycle rule removes them (docs/storage.md).
"""

from __future__ import annotations

import json
import re
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._checkpoint import SHARD, read_weight_map
from ._errors import SafetensorsError
from ._object_store import Url, call, listing, obstore_for, previous_copy, store
from ._storage import open_storage, read_range

_SUFFIX = ".safetensors"
MULTIPART = 64 << 20  # objects of more bytes go up in parts
PART = 16 << 20  # bytes per part
PARTS_AT_ONCE = 8  # parts of one object uploading at once


class ObjectCommit:
    """One save of the checkpoint at the URL `target`, committed in one request (see the
    module's docstring). `write(file, tensors, metadata)` writes one sealed safetensors
    file to a local scratch path, which is uploaded and removed; a shard at a time is on
    local disk.

    Saves to one URL from two processes at once are not supported: each would take the
    other's new shards for a failed save's leftovers (on a local disk a lock prevents it;
    an object store has none)."""

    def __init__(self, target: Url, write: Callable[[Path, dict[str, Any], dict[str, str]], None]):
        self.target, self.folder, self.write = target, target.parent, write
        self.index = target.with_name(f"{target.name}.index.json")
        self.record = target.with_name(f".{target.name}.previous.json")  # (see `_keep`)
        self.stem = target.name[: -len(_SUFFIX)]
        self.warnings: list[str] = []

    def save(self, files: list[tuple[dict[str, Any], dict[str, str]]]) -> list[Url]:
        present, committed, previous = self._tidy()
        stale = [self.index] if self.index.name in present else []  # (a new one object's)
        with tempfile.TemporaryDirectory(prefix="taktiny-save-") as scratch:
            if len(files) == 1:
                kept = self._keep(committed, previous)
                self._upload(Path(scratch), self.target, *files[0])  # the commit
                return self._finish([self.target], kept, stale + previous)
            token = uuid.uuid4().hex[:8]
            count = len(files)
            names = [
                f"{self.stem}-{i:05d}-of-{count:05d}-{token}{_SUFFIX}" for i in range(1, count + 1)
            ]
            shards = [self.folder / n for n in names]
            sent: list[Url] = []
            try:
                for url, (tensors, metadata) in zip(shards, files, strict=True):
                    sent.append(url)
                    self._upload(Path(scratch), url, tensors, metadata)
                weight_map = {
                    k: n for n, (tensors, _) in zip(names, files, strict=True) for k in tensors
                }
                total = sum(a.nbytes for tensors, _ in files for a in tensors.values())
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                kept = self._keep(committed, previous)
                self._put(self.index, (json.dumps(index, indent=2) + "\n").encode())
                sent.insert(0, self.index)
                if self.target.name in present:  # the one object shadows the new index
                    self._delete([self.target])  # the commit
            except BaseException:
                self._undo(sent, names)
                raise
            return self._finish([*shards, self.index], kept, previous)

    def _tidy(self) -> tuple[set[str], dict[Url, str | None], list[Url]]:
        """Removes what failed saves left; returns the names in the folder, the objects of
        the committed checkpoint (with their ETags), and those of the checkpoint before it
        that the last save kept (as its record names them)."""
        etags = {m["path"].rsplit("/", 1)[-1]: m["e_tag"] for m in listing(self.folder)}
        present = set(etags)
        shards = {n for n in present if self._shard(n)}
        copies = {n for n in present if self._copy(n)}
        recorded = self._recorded() if self.record.name in present else set()
        if self.target.name in present:  # the one object: an index beside it is stale
            committed, stale = {self.target.name}, {self.index.name} & present
        elif self.index.name in present:
            named = self._named()  # (unreadable: every shard may be the committed ones)
            committed, stale = (shards & named if named else shards), set()
        else:
            committed, stale = set(), set()
        leftovers = ((shards | copies) - committed - recorded) | stale
        self._delete([self.folder / n for n in sorted(leftovers)])
        self._abort_uploads()
        previous = [self.folder / n for n in sorted((recorded & present) - committed)]
        return present - leftovers, {self.folder / n: etags[n] for n in committed}, previous

    def _keep(self, committed: dict[Url, str | None], previous: list[Url]) -> list[Url]:
        """Before the commit: keeps the committed checkpoint readable after it, for one more
        save, and returns its objects so kept. Shards are kept as they are (a save never
        writes over one); the one object, which the commit writes over or removes, is
        copied within the store to the name its readers look for it under once it has
        gone (`previous_copy`). The record (``.<name>.previous.json``) then names these and
        the objects kept before (the next save removes them after its own commit; a save
        that fails before its commit leaves them all)."""
        kept = [u for u in committed if u != self.target]
        etag = committed.get(self.target)
        if self.target in committed and etag is not None:
            copy = previous_copy(self.target, etag)
            obstore = obstore_for(copy)
            source, key = self.target.key, copy.key
            try:
                call(copy, "COPY", lambda: obstore.copy_async(store(copy), source, key))
                kept.append(copy)
            except (OSError, ValueError) as error:  # (S3 copies at most 5 GiB at once)
                self.warnings.append(
                    f"save_safetensors: {self.target}: the previous checkpoint could not be "
                    f"kept for the readers that opened it ({error}); their reads raise Replaced."
                )
        names = sorted({u.name for u in [*previous, *kept]})
        if names:
            self._put(self.record, (json.dumps({"previous": names}, indent=2) + "\n").encode())
        return kept

    def _recorded(self) -> set[str]:
        """The names the record of kept objects gives (none when it is unreadable: then
        what it named is taken for leftovers, which only the readers of a checkpoint two
        saves old notice)."""
        try:
            text = read_range(open_storage(self.record), 0, 1 << 20)
            names = json.loads(text)["previous"]
        except (OSError, ValueError, KeyError, TypeError):
            return set()
        return (
            {n for n in names if isinstance(n, str) and "/" not in n}
            if isinstance(names, list)
            else set()
        )

    def _abort_uploads(self) -> None:
        """Aborts the incomplete multipart uploads of this checkpoint's names (a killed
        save's), for an ``s3://`` URL; a failure to list or abort them is a warning."""
        if self.target.scheme not in ("s3", "s3a"):
            return
        try:
            import boto3
        except ImportError:
            self.warnings.append(
                f"save_safetensors: {self.target}: boto3 is not installed, so incomplete "
                f"multipart uploads of killed saves are not removed: pip install "
                f"'taktiny[cloud]', or configure the bucket's lifecycle rule for them."
            )
            return
        prefix = self.folder.key
        try:
            client = boto3.client("s3")  # (endpoint, keys and region from the environment)
            pages = client.get_paginator("list_multipart_uploads")
            for page in pages.paginate(Bucket=self.target.bucket, Prefix=prefix):
                for upload in page.get("Uploads", []):
                    name = upload["Key"][len(prefix) :]
                    if "/" not in name and self._ours(name):
                        client.abort_multipart_upload(
                            Bucket=self.target.bucket,
                            Key=upload["Key"],
                            UploadId=upload["UploadId"],
                        )
        except Exception as error:  # noqa: BLE001 - botocore's errors share no base it exports
            self.warnings.append(
                f"save_safetensors: {self.target}: incomplete multipart uploads of killed saves "
                f"could not be removed ({type(error).__name__}: {error}); configure the "
                f"bucket's lifecycle rule for them."
            )

    def _ours(self, name: str) -> bool:
        return name in (self.target.name, self.index.name) or self._shard(name)

    def _named(self) -> set[str]:
        """The shards the committed index names (none when it is unreadable: then no shard
        is taken for a leftover)."""
        try:
            return set(read_weight_map(self.index).values())
        except (OSError, SafetensorsError):
            return set()

    def _upload(
        self, scratch: Path, url: Url, tensors: dict[str, Any], metadata: dict[str, str]
    ) -> None:
        file = scratch / url.name
        self.write(file, tensors, metadata)
        try:
            self._put(url, file)
        finally:
            file.unlink(missing_ok=True)

    def _put(self, url: Url, data: Path | bytes) -> None:
        put_object(url, data)

    def _delete(self, urls: list[Url]) -> None:
        obstore = obstore_for(self.folder)
        if urls:
            keys = [u.key for u in urls]
            call(self.folder, "DELETE", lambda: obstore.delete_async(store(self.folder), keys))

    def _undo(self, sent: list[Url], names: list[str]) -> None:
        """After a failure, unless the commit happened: removes the new objects, leaving the
        previous checkpoint as it was (what this cannot remove, the next save does)."""
        try:
            present = {m["path"].rsplit("/", 1)[-1] for m in listing(self.folder)}
            if self.target.name not in present and set(names) <= self._named():
                return  # committed: the new checkpoint stays
            self._delete(sent)
        except (OSError, ValueError):  # the failure being raised is the one to report
            pass

    def _finish(self, written: list[Url], kept: list[Url], old: list[Url]) -> list[Url]:
        """After the commit: removes `old` (the objects that the save before kept, and a
        stale index), but what this save wrote or kept, and the record too when it keeps
        nothing; a failure is a warning (the next save removes them)."""
        gone = [u for u in old if u not in written and u not in kept]
        if not kept:
            gone.append(self.record)
        try:
            self._delete(gone)
        except OSError as error:
            self.warnings.append(
                f"save_safetensors: {self.target} is saved, but removing the objects of the "
                f"checkpoint before the previous one failed ({error}); the next save to it "
                f"removes them."
            )
        return written

    def _shard(self, name: str) -> bool:
        return (found := SHARD.fullmatch(name)) is not None and found.group(1) == self.stem

    def _copy(self, name: str) -> bool:
        """Whether `name` is a kept copy of this checkpoint's one object (`previous_copy`)."""
        return (
            re.fullmatch(rf"\.{re.escape(self.target.name)}\.[0-9a-f]{{16}}\.previous", name)
            is not None
        )


def put_object(url: Url, data: Path | bytes) -> None:
    """Writes `data` (a local file's bytes, or bytes) as the object `url`, replacing it
    whole in one step (large ones in parallel parts), retried as every request is."""
    obstore = obstore_for(url)
    size = data.stat().st_size if isinstance(data, Path) else len(data)
    call(
        url,
        "PUT",
        lambda: obstore.put_async(
            store(url),
            url.key,
            data,
            use_multipart=size > MULTIPART,
            chunk_size=PART,
            max_concurrency=PARTS_AT_ONCE,
        ),
    )
