"""A save to object storage, committed without a rename: the object store's counterpart of
`_save._Commit`.

An object store has no rename and no directory to flush, but a ``PUT`` of one object (a
multipart upload too, at its completion) replaces it whole, in one step every reader
sees at once. So a save writes what no reader reads yet, then commits with one request:

1. it removes what earlier saves left when they failed or were killed (shards that the
   committed index does not name, an index that a committed single object shadows);
2. each new shard goes up under a name unique to the save
   (``model-00001-of-00003-1a2b3c4d.safetensors``), large ones in parallel parts;
3. one request commits: the ``PUT`` of the single object; for shards, the ``PUT`` of the
   index, or, when the path held one object, that object's removal (it shadows the
   index, as on disk);
4. the previous checkpoint's objects are removed.

A reader that opened the previous checkpoint reads its objects by their ETags: once they
are replaced or removed its reads fail with `Replaced`, and the load opens the checkpoint
again (see `_object_store`).

A process killed during a multipart upload leaves the upload's parts on the server,
invisible to listings. obstore 0.12 can neither list nor abort such uploads, so step 1
does it for an ``s3://`` URL through boto3 (part of the ``taktiny[cloud]`` extra, imported
only then): the incomplete uploads of this checkpoint's names are aborted. Elsewhere a
bucket lifecycle rule removes them (docs/storage.md).
"""

from __future__ import annotations

import json
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._checkpoint import SHARD, read_weight_map
from ._object_store import Url, call, listing, obstore_for, store
from ._read import SafetensorsError

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
        self.stem = target.name[: -len(_SUFFIX)]
        self.warnings: list[str] = []

    def save(self, files: list[tuple[dict[str, Any], dict[str, str]]]) -> list[Url]:
        present, old = self._tidy()
        with tempfile.TemporaryDirectory(prefix="taktiny-save-") as scratch:
            if len(files) == 1:
                self._upload(Path(scratch), self.target, *files[0])  # the commit
                stale = [self.index] if self.index.name in present else []
                return self._finish([self.target], stale + old)
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
                self._put(self.index, (json.dumps(index, indent=2) + "\n").encode())
                sent.insert(0, self.index)
                if self.target.name in present:  # the one object shadows the new index
                    self._delete([self.target])  # the commit
            except BaseException:
                self._undo(sent, names)
                raise
            return self._finish([*shards, self.index], old)

    def _tidy(self) -> tuple[set[str], list[Url]]:
        """Removes what failed saves left; returns the names in the folder, and the objects
        of the committed checkpoint."""
        present = {m["path"].rsplit("/", 1)[-1] for m in listing(self.folder)}
        shards = {n for n in present if self._shard(n)}
        if self.target.name in present:
            old, leftovers = [self.target], shards | ({self.index.name} & present)
        elif self.index.name in present:
            named = self._named()
            old = [self.folder / n for n in sorted(shards & named)]
            leftovers = shards - named if named else set()
        else:
            old, leftovers = [], shards
        self._delete([self.folder / n for n in sorted(leftovers)])
        self._abort_uploads()
        return present - leftovers, old

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

    def _finish(self, written: list[Url], old: list[Url]) -> list[Url]:
        """After the commit: removes the previous checkpoint's objects; a failure is a
        warning (the next save removes them)."""
        try:
            self._delete([u for u in old if u not in written])
        except OSError as error:
            self.warnings.append(
                f"save_safetensors: {self.target} is saved, but removing the previous "
                f"checkpoint's objects failed ({error}); the next save to it removes them."
            )
        return written

    def _shard(self, name: str) -> bool:
        return (found := SHARD.fullmatch(name)) is not None and found.group(1) == self.stem
