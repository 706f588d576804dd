"""Checkpoints in object storage: ``s3://``, ``gs://``, ``az://`` and ``https://`` URLs, read
by ranges and written whole, through obstore (the ``taktiny[cloud]`` extra).

A `Url` names an object as a `Path` names a file (its ``name``, its ``parent``, a name
beside it), so that the code that finds a checkpoint's files and names them in messages
takes either. `RemoteFile` is the `Storage` (`_storage`) of one object: it reads the
object that was there when it was opened, by its ETag (``If-Match``, every part), never a
mix of two checkpoints: once a save has written over it or removed it, from the copy that
save kept (`previous_copy`), and once the next save has removed that too, its reads fail
with `Replaced` (a load opens the checkpoint again then). A large read is cut
into parts fetched at once, at most `IN_FLIGHT` parts per process at a time, each retried
with backoff when the server throttles, fails or drops the connection.

Nothing here imports obstore until a URL is read or written: local paths never need it.
Credentials and endpoints come from the environment, as obstore reads them (``AWS_*``,
``AWS_ENDPOINT_URL``, ``GOOGLE_*``, ``AZURE_*``); an ``http://`` endpoint (a local test
server) is allowed when the environment names one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import mmap
import os
import random
import re
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ._errors import SafetensorsError
from ._waits import result_of, waited

SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss", "azure", "http", "https")
_URL = re.compile(rf"({'|'.join(SCHEMES)})://([^/]+)/(.*)", re.IGNORECASE)
PART = 8 << 20  # bytes per ranged GET of a large read
IN_FLIGHT = 32  # ranged GETs in flight per process at most (PART bytes each)
ATTEMPTS = 6  # tries of a ranged GET that fails for a reason a retry may cure
BACKOFF = (0.1, 5.0)  # the first wait between tries, and the longest, in seconds
TIMEOUT = "60s"  # the most one request may take (a stalled server is retried after it)
_T = TypeVar("_T")


class Url:
    """An object's URL (``s3://bucket/prefix/model.safetensors``), with the parts of the
    `Path` API that naming a checkpoint's files needs: ``name``, ``parent``, ``/`` and
    ``with_name``. ``str()`` gives the URL back."""

    __slots__ = ("bucket", "key", "scheme")

    def __init__(self, url: str):
        found = _URL.fullmatch(url)
        if found is None:
            raise ValueError(f"{url!r} is not an object-store URL (scheme://bucket/key)")
        self.scheme, self.bucket, self.key = found.group(1).lower(), found.group(2), found.group(3)

    @property
    def root(self) -> str:
        """The store's URL: ``s3://bucket``."""
        return f"{self.scheme}://{self.bucket}"

    @property
    def name(self) -> str:
        """The last part of the key (``model.safetensors``)."""
        return self.key.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Url:
        """The "folder": the key up to its last ``/``."""
        head = self.key.rstrip("/").rpartition("/")[0]
        return Url(f"{self.root}/{head}/" if head else f"{self.root}/")

    @property
    def folder(self) -> bool:
        """Whether the URL names a prefix (ends with ``/``) rather than an object."""
        return self.key == "" or self.key.endswith("/")

    def __truediv__(self, name: str) -> Url:
        return Url(f"{self.root}/{self.key.rstrip('/') + '/' if self.key.strip('/') else ''}{name}")

    def with_name(self, name: str) -> Url:
        return self.parent / name

    def __str__(self) -> str:
        return f"{self.root}/{self.key}"

    def __repr__(self) -> str:
        return f"Url({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Url) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


def locate(path: str | os.PathLike[str]) -> Path | Url:
    """`path` as a local `Path`, or a `Url` for a string with an object store's scheme.
    Raises `MissingExtra` for a URL when obstore is not installed: before anything else
    is done for it."""
    if isinstance(path, Url):
        obstore_for(path)
        return path
    if isinstance(path, str) and _URL.fullmatch(path):
        obstore_for(url := Url(path))
        return url
    if isinstance(path, str) and re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", path):
        scheme = path.split("://", 1)[0]
        raise ValueError(
            f"{path!r}: the scheme {scheme!r} is not one Taktiny reads; name a local path, or a "
            f"URL of {', '.join(s + '://' for s in SCHEMES)} with a bucket and a key"
        )
    return Path(path)


class Replaced(SafetensorsError):
    """An object of an opened checkpoint was replaced or removed (by a save) since it was
    opened: its bytes are no longer those its header described. Open it again."""


class MissingExtra(ImportError):
    """A package that what was asked needs is not installed: the message names the
    ``pip install`` command of Taktiny's extra that brings it (``taktiny[cloud]`` for a
    URL, ``taktiny[safetensors]`` for a save)."""


def obstore_for(url: Url) -> Any:
    """The obstore module, for a request on `url`; `MissingExtra` naming the URL and the
    command that installs it when it is not installed."""
    try:
        import obstore
        import obstore.exceptions
        import obstore.store
    except ImportError:
        raise MissingExtra(
            f"{url}: reading and writing object storage needs obstore, which is not "
            f"installed: pip install 'taktiny[cloud]'",
            name="obstore",
        ) from None
    return obstore


def store(url: Url) -> Any:
    """The obstore store of `url`'s bucket, made once per bucket and environment: a
    changed endpoint or credential (any ``AWS_*``, ``GOOGLE_*`` or ``AZURE_*`` variable,
    or a proxy's) makes a new one."""
    key = (url.root, *sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENVIRONMENT)))
    with _LOCK:
        found = _STORES.get(key)
        if found is None:
            found = _STORES[key] = _make_store(url)
        return found


# the variables obstore reads a store's endpoint, credentials and client options from
_ENVIRONMENT = ("AWS_", "GOOGLE_", "AZURE_", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
_STORES: dict[tuple[Any, ...], Any] = {}
_LOCK = threading.Lock()


def _make_store(url: Url) -> Any:
    from_url = obstore_for(url).store.from_url
    endpoint = _endpoint_variable()
    options: dict[str, Any] = {"timeout": TIMEOUT, "connect_timeout": "10s"}
    if url.scheme == "http" or endpoint.startswith("http://"):
        options["allow_http"] = True
    retry = {"max_retries": 4, "retry_timeout": timedelta(seconds=120)}
    failed = obstore_for(url).exceptions
    try:
        return from_url(url.root, client_options=options, retry_config=retry)  # pyright: ignore
    except (failed.BaseError, ValueError) as error:
        raise ValueError(f"{url}: cannot open the object store: {error}") from None


class _Loop:
    """One asyncio loop on a daemon thread, on which every ranged GET of the process runs
    (obstore's requests are coroutines), at most `IN_FLIGHT` at once."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.slots = asyncio.Semaphore(IN_FLIGHT)
        threading.Thread(target=self.loop.run_forever, name="taktiny-objects", daemon=True).start()

    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)


_loop: _Loop | None = None


def _running() -> _Loop:
    global _loop
    with _LOCK:
        if _loop is None:
            _loop = _Loop()
        return _loop


def previous_copy(url: Url, etag: str) -> Url:
    """Where a save keeps a copy of the object at `url` whose ETag is `etag` before it
    writes over it or removes it (`_object_commit.ObjectCommit._keep`), for the readers
    that opened it: ``.model.safetensors.<16 hex digits>.previous`` beside it (hidden: no
    folder listing takes it for a checkpoint)."""
    digest = hashlib.sha256(etag.strip().strip('"').encode()).hexdigest()[:16]
    return url.with_name(f".{url.name}.{digest}.previous")


class RemoteFile:
    """One object, opened: its size and ETag read once (a ``HEAD``), and every read of it a
    ranged ``GET`` that must match that ETag. A `Storage`.

    When a save has written over the object or removed it since (its ETag no longer
    matches), the reads go on from the copy that the save kept of it
    (`previous_copy`), until the save after removes that too: then they raise `Replaced`.

    Raises FileNotFoundError (naming the URL) when there is no such object."""

    __slots__ = ("__weakref__", "etag", "futures", "lock", "size", "source", "url")
    large_reads: ClassVar[bool] = True

    def __init__(self, url: Url):
        self.url = url
        meta = _head(url)
        self.size: int = meta["size"]
        self.etag: str | None = meta["e_tag"]
        self.source: tuple[Url, str | None] = (url, self.etag)  # what the reads ask for
        self.futures: set[concurrent.futures.Future[Any]] = set()
        self.lock = threading.Lock()

    @property
    def name(self) -> Url:
        return self.url

    def read_into(self, offset: int, buffer: memoryview) -> int:
        source = self.source
        try:
            return self._read(source, offset, buffer)
        except Replaced:
            moved = self._follow(source)
            if moved is None:
                raise
            return self._read(moved, offset, buffer)

    def _read(self, source: tuple[Url, str | None], offset: int, buffer: memoryview) -> int:
        count = max(0, min(len(buffer), self.size - offset))
        if not count:
            return 0
        loop = _running()
        futures = [
            loop.submit(
                self._part(
                    loop, source, at, buffer[at - offset : min(at + PART, offset + count) - offset]
                )
            )
            for at in range(offset, offset + count, PART)
        ]
        self.futures.update(futures)
        try:
            waited(futures)
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        finally:
            self.futures.difference_update(futures)
        return count

    def _follow(self, source: tuple[Url, str | None]) -> tuple[Url, str | None] | None:
        """Where the reads go on after `source` was found replaced: the copy a save kept
        of the object (checked by its size), or None when there is none."""
        with self.lock:
            if self.source is not source:  # (another read has followed it already)
                return self.source
            if source[0] != self.url or self.etag is None:  # (the copy itself is gone)
                return None
            copy = previous_copy(self.url, self.etag)
            try:
                meta = _head(copy)
            except FileNotFoundError:
                return None
            if meta["size"] != self.size:
                return None
            self.source = (copy, meta["e_tag"])
            return self.source

    async def _part(
        self, loop: _Loop, source: tuple[Url, str | None], offset: int, into: memoryview
    ) -> None:
        url, etag = source
        obstore = obstore_for(url)
        options: dict[str, Any] = {"range": (offset, offset + len(into))}
        if etag is not None:
            options["if_match"] = etag

        async def get() -> Any:
            result = await obstore.get_async(store(url), url.key, options=options)  # pyright: ignore
            data = await result.bytes_async()
            if len(data) != len(into):  # (a connection dropped mid-body: tried again)
                raise ConnectionError(f"{len(data)} bytes came back for {len(into)} asked")
            return data

        async with loop.slots:
            try:
                data = await _tried(url, "GET", get)
            except (FileNotFoundError, Replaced):
                raise _gone(self.url) from None
            into[:] = memoryview(data)

    def advise(self, offset: int, size: int) -> None:
        """Nothing: a read of an object fetches its parts at once when it is made."""

    def mapped(self, offset: int, size: int) -> memoryview | None:
        """None: an object's bytes are fetched, never mapped."""
        return None

    def take_mappings(self) -> list[mmap.mmap]:
        """None to take: nothing is mapped."""
        return []

    def interrupt(self) -> None:
        """Cancels the reads in flight (they raise CancelledError): a load stopped by an
        error or Ctrl-C does not wait for them."""
        for future in list(self.futures):
            future.cancel()

    def replaced(self) -> bool:
        """Whether the URL now names another object than the one opened (or none)."""
        try:
            return _head(self.url)["e_tag"] != self.etag
        except FileNotFoundError:
            return True

    def close(self) -> None:
        """Nothing to release: requests are made per read."""


def _head(url: Url) -> Any:
    """The object's metadata (``size``, ``e_tag``), by a HEAD; FileNotFoundError without one."""
    obstore = obstore_for(url)
    return call(url, "HEAD", lambda: obstore.head_async(store(url), url.key))


def _wait(attempt: int) -> float:
    """Seconds before try `attempt + 2`: exponential, with full jitter."""
    return random.uniform(0, min(BACKOFF[1], BACKOFF[0] * 2**attempt))


def _final(url: Url, method: str, error: Exception, attempt: int) -> BaseException | None:
    """The error to raise for a request that failed with `error` on try `attempt + 1`, or
    None to try again."""
    failed = obstore_for(url).exceptions
    if isinstance(error, failed.PreconditionError):
        return _gone(url)
    text = str(error)
    status = re.search(r"status code: (\d{3})\b", text)
    if isinstance(error, failed.PermissionDeniedError | failed.UnauthenticatedError) or (
        status is not None and status.group(1) in ("401", "403")
    ):
        return PermissionError(
            f"{url}: {method} was refused ({type(error).__name__}); check the credentials "
            f"in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ...) "
            f"and the bucket's policy. {_first_line(error)}"
        )
    if status is not None and status.group(1) == "404":  # (a LIST's: obstore's GenericError)
        return _missing(url, method, error)
    if not isinstance(error, failed.BaseError | OSError):  # not the server's: a bug, raised
        return error
    if isinstance(error, failed.InvalidPathError | failed.UnknownConfigurationKeyError):
        return ValueError(f"{url}: {_first_line(error)}")
    unreachable = re.search(_UNREACHABLE, text) is not None
    if unreachable and (_store_key(url) not in _reached or attempt + 1 >= ATTEMPTS):
        return _unreachable(url, method, error, attempt + 1)
    if attempt + 1 >= ATTEMPTS:
        return ConnectionError(
            f"{url}: {method} failed {ATTEMPTS} times, the last with {type(error).__name__}: "
            f"{_first_line(error)}. The server keeps failing; try again later."
        )
    return None


# how obstore (reqwest, hyper) says that no connection could be made to the endpoint
_UNREACHABLE = re.compile(r"kind: Connect\b|tcp connect error|dns error|error trying to connect")
# the stores this process has had an answer from (`_store_key`): a connection refused by
# one of them is retried as a passing fault; by any other, the endpoint is taken for wrong
_reached: set[tuple[str, str]] = set()


def _store_key(url: Url) -> tuple[str, str]:
    return url.root, _endpoint_variable()


def _endpoint_variable() -> str:
    """The endpoint the environment names for S3 (``AWS_ENDPOINT_URL``), or ''."""
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT") or ""


def _endpoint(url: Url, error: BaseException) -> str:
    """The endpoint a failed request went to (``http://10.0.0.5:9000``), as obstore's
    message names it, or as the environment does."""
    found = re.search(r"Error performing \w+ (\w+://[^/\s]+)", str(error))
    return found.group(1) if found else _endpoint_variable() or url.root


def _where(url: Url) -> str:
    """What to check when `url`'s store cannot be found at its endpoint."""
    if url.scheme not in ("s3", "s3a"):
        return "check the URL and the network"
    named = _endpoint_variable()
    setting = f"is {named!r}" if named else "is not set, so AWS's own S3 is asked"
    return (
        f"check AWS_ENDPOINT_URL (it {setting}; an S3-compatible server needs it), "
        f"AWS_REGION and the network"
    )


def _unreachable(url: Url, method: str, error: BaseException, tries: int) -> ConnectionError:
    reason = re.search(r'message: "([^"]+)"', str(error))
    why = reason.group(1) if reason else _first_line(error)
    after = "obstore's retries" if tries == 1 else f"{tries} tries"
    return ConnectionError(
        f"{url}: {method} could not connect to {_endpoint(url, error)} ({why}, after "
        f"{after}); {_where(url)}."
    )


def _missing(url: Url, method: str, error: BaseException) -> FileNotFoundError:
    """The error for a request answered 404: no such bucket (a listing's or a write's 404,
    or S3's ``NoSuchBucket``), or no such object."""
    if method in ("LIST", "PUT", "DELETE") or "NoSuchBucket" in str(error):
        return NoSuchBucket(
            f"{url}: no such bucket {url.bucket!r} at {_endpoint(url, error)}; create it, "
            f"or {_where(url)}."
        )
    return FileNotFoundError(f"{url}: no such object.")


class NoSuchBucket(FileNotFoundError):
    """A request named a bucket the store does not have; the message names the bucket and
    the endpoint asked."""


def _gone(url: Url) -> Replaced:
    return Replaced(
        f"{url}: the object was replaced or removed since the checkpoint was opened (a save "
        f"over it); open the checkpoint again."
    )


def _first_line(error: BaseException) -> str:
    return str(error).strip().split("\n", 1)[0][:300]


def call(url: Url, method: str, request: Callable[[], Awaitable[_T]]) -> _T:
    """The result of `request()` (an obstore coroutine on `url`; `method` names it in
    messages), run on the loop's thread and retried as the ranged GETs are; a missing
    object is FileNotFoundError naming the URL. Ctrl-C stops the caller's wait at once
    (`_waits.waited`), and the request is cancelled."""
    future = _running().submit(_tried(url, method, request))
    try:
        return result_of(future)
    except BaseException:
        future.cancel()
        raise


async def _tried(url: Url, method: str, request: Callable[[], Awaitable[_T]]) -> _T:
    failed = obstore_for(url).exceptions
    for attempt in range(ATTEMPTS):
        try:
            answer = await request()
        except (FileNotFoundError, failed.NotFoundError) as error:  # (obstore raises the first)
            raise _missing(url, method, error) from None
        except Exception as error:  # noqa: BLE001 - `_final` raises what is not the server's
            final = _final(url, method, error, attempt)
            if final is not None:
                raise final from None
            await asyncio.sleep(_wait(attempt))
        else:
            _reached.add(_store_key(url))
            return answer
    raise AssertionError("unreachable")  # pragma: no cover


def listing(folder: Url) -> Iterator[Any]:
    """The objects directly under `folder` (a prefix ending in ``/``): obstore's metadata
    of each (``path``, ``size``, ``e_tag``). `NoSuchBucket` when the bucket is missing."""
    yield from listed(folder)["objects"]


def listed(folder: Url) -> Any:
    """What is directly under `folder` (a prefix ending in ``/``), as obstore lists it:
    ``objects`` (the metadata of each) and ``common_prefixes`` (the "folders")."""
    obstore = obstore_for(folder)
    prefix = folder.key.rstrip("/")
    return call(
        folder, "LIST", lambda: obstore.list_with_delimiter_async(store(folder), prefix or None)
    )
