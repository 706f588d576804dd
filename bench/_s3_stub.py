#!/usr/bin/env python
"""A read-only S3-compatible server for benchmarks: the files of a local folder served as the
objects of any bucket, each byte sent with ``os.sendfile`` (zero-copy), so that the server
is not what a benchmark of the clients measures. (moto is: it reads the whole object for
every ranged GET, ~47 MiB/s; see object-store-clients.md.)

    python -m bench._s3_stub FOLDER [--port PORT]   # prints "http://127.0.0.1:PORT", serves

or, from Python, ``Stub(folder)`` (the server in a process of its own, stopped by
``stop()`` or as a context manager) and ``stub.environment()`` (what obstore, s3fs and
Run:ai's streamer read to reach it).

What it speaks, path-style (``/BUCKET/KEY``; the bucket's name is not checked):

- ``HEAD`` and ``GET`` of an object: ``Content-Length``, ``ETag`` (of the file's inode, size
  and modification time, so a file written over gets a new one), ``Last-Modified``;
  ``Range: bytes=a-b`` / ``a-`` / ``-n`` answered 206 with ``Content-Range`` (416 past the
  end); ``If-Match`` answered 412 when it names another ETag, ``If-None-Match`` 304 when it
  names this one. A missing object is 404 ``NoSuchKey``.
- ``HEAD /BUCKET`` (HeadBucket) 200; ``GET /BUCKET?list-type=2&prefix=&delimiter=``
  (ListObjectsV2, and the v1 listing the same way) as XML: ``Contents`` and
  ``CommonPrefixes``, every key in one page.
- Anything else (PUT, DELETE, POST) is 501: objects are added by writing files into the
  folder. No request is authenticated; signatures are ignored.

A ThreadingHTTPServer with HTTP/1.1 keep-alive: one thread per connection.
"""

from __future__ import annotations

import argparse
import email.utils
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from xml.sax.saxutils import escape


def _etag(stat: os.stat_result) -> str:
    return f'"{stat.st_ino:x}-{stat.st_size:x}-{stat.st_mtime_ns:x}"'


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY: a small answer is written as headers then body, and with Nagle's
    # algorithm the body's segment waits for the client's delayed ACK (40 ms a request)
    disable_nagle_algorithm = True
    root: Path = Path(".")  # set on the server's subclass

    def log_message(self, *args: object) -> None:
        pass

    # --- answers ---------------------------------------------------------------------
    def _send(self, code: int, body: bytes = b"", kind: str = "application/xml", **headers: str):
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _error(self, code: int, name: str, message: str) -> None:
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{name}</Code>'
            f"<Message>{escape(message)}</Message></Error>"
        ).encode()
        self._send(code, body)

    def _split(self) -> tuple[str, str, dict[str, list[str]]]:
        parsed = urllib.parse.urlsplit(self.path)
        bucket, _, key = urllib.parse.unquote(parsed.path).lstrip("/").partition("/")
        return bucket, key, urllib.parse.parse_qs(parsed.query, keep_blank_values=True)

    def _file(self, key: str) -> Path | None:
        path = (self.root / key).resolve()
        if not key or self.root not in path.parents or not path.is_file():
            return None
        return path

    # --- methods -----------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._object(body=False)

    def do_GET(self) -> None:
        self._object(body=True)

    def _refuse(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.close_connection = "chunked" in self.headers.get("Transfer-Encoding", "")
        self._error(501, "NotImplemented", "this stub is read-only: write files into its folder")

    do_PUT = do_POST = do_DELETE = _refuse

    def _object(self, body: bool) -> None:
        bucket, key, query = self._split()
        if not bucket:
            return self._error(501, "NotImplemented", "ListBuckets is not served")
        if not key:
            if not body:  # HeadBucket
                return self._send(200)
            return self._list(bucket, query)
        path = self._file(key)
        if path is None:
            return self._error(404, "NoSuchKey", f"{key}: no such object")
        with open(path, "rb") as file:
            stat = os.fstat(file.fileno())
            etag, size = _etag(stat), stat.st_size
            modified = email.utils.formatdate(stat.st_mtime, usegmt=True)
            wanted = self.headers.get("If-Match")
            if wanted is not None and wanted.strip() not in ("*", etag):
                return self._error(412, "PreconditionFailed", "If-Match does not match")
            unwanted = self.headers.get("If-None-Match")
            if unwanted is not None and unwanted.strip() in ("*", etag):
                return self._send(304, ETag=etag)
            start, end, code = 0, size, 200
            asked = self.headers.get("Range")
            if asked:
                try:
                    first, _, last = asked.strip().removeprefix("bytes=").partition("-")
                    if first:
                        start, end = int(first), min(int(last) + 1 if last else size, size)
                    else:  # the last n bytes
                        start, end = max(0, size - int(last)), size
                except ValueError:
                    return self._error(400, "InvalidArgument", f"bad Range {asked!r}")
                if start >= size or start >= end:
                    return self._error(416, "InvalidRange", f"{asked} of {size} bytes")
                code = 206
            self.send_response(code)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            if code == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", etag)
            self.send_header("Last-Modified", modified)
            self.end_headers()
            if not body:
                return None
            self.wfile.flush()
            socket, offset = self.connection.fileno(), start
            while offset < end:
                sent = os.sendfile(socket, file.fileno(), offset, end - offset)
                if sent == 0:  # the client went away
                    self.close_connection = True
                    return None
                offset += sent
        return None

    def _list(self, bucket: str, query: dict[str, list[str]]) -> None:
        prefix = query.get("prefix", [""])[0]
        delimiter = query.get("delimiter", [""])[0]
        v2 = query.get("list-type", [""])[0] == "2"
        after = query.get("start-after", [""])[0]
        objects: list[tuple[str, os.stat_result]] = []
        prefixes: set[str] = set()
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                path = Path(dirpath, name)
                key = path.relative_to(self.root).as_posix()
                if not key.startswith(prefix) or key <= after:
                    continue
                rest = key[len(prefix) :]
                if delimiter and delimiter in rest:
                    prefixes.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
                else:
                    objects.append((key, path.stat()))
        objects.sort()
        parts = [
            '<?xml version="1.0" encoding="UTF-8"?>',
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
            f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>",
            "<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>",
        ]
        if delimiter:
            parts.append(f"<Delimiter>{escape(delimiter)}</Delimiter>")
        if v2:
            parts.append(f"<KeyCount>{len(objects) + len(prefixes)}</KeyCount>")
        else:
            parts.append("<Marker></Marker>")
        for key, stat in objects:
            when = datetime.fromtimestamp(stat.st_mtime, UTC)
            parts.append(
                f"<Contents><Key>{escape(key)}</Key>"
                f"<LastModified>{when.strftime('%Y-%m-%dT%H:%M:%S.000Z')}</LastModified>"
                f"<ETag>{escape(_etag(stat))}</ETag><Size>{stat.st_size}</Size>"
                "<StorageClass>STANDARD</StorageClass></Contents>"
            )
        for name in sorted(prefixes):
            parts.append(f"<CommonPrefixes><Prefix>{escape(name)}</Prefix></CommonPrefixes>")
        parts.append("</ListBucketResult>")
        self._send(200, "".join(parts).encode())


def serve(folder: Path, port: int = 0) -> ThreadingHTTPServer:
    """The server of `folder` on 127.0.0.1 (`port`, or a free one), not yet serving."""
    handler = type("Handler", (Handler,), {"root": Path(folder).resolve()})
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.request_queue_size = 256
    return ThreadingHTTPServer(("127.0.0.1", port), handler)


class Stub:
    """The stub serving `folder`, in a process of its own on 127.0.0.1 (so that its work is
    not done under the measuring process's GIL)."""

    def __init__(self, folder: Path) -> None:
        root = Path(__file__).resolve().parent.parent
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench._s3_stub", str(folder)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=root,
        )
        assert self.process.stdout is not None
        self.url = self.process.stdout.readline().strip()
        if not self.url.startswith("http://"):
            self.stop()
            raise RuntimeError(f"the S3 stub did not start (it said {self.url!r})")
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(
                    urllib.request.Request(f"{self.url}/b", method="HEAD"), timeout=1
                ).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the S3 stub does not answer on {self.url}") from None
                time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.process.pid

    def environment(self) -> dict[str, str]:
        """The variables that point obstore, s3fs (botocore) and Run:ai's streamer at it."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",  # obstore: an http:// endpoint
            "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata lookups
            "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",  # path-style, as its docs say
        }

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()

    def __enter__(self) -> Stub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    server = serve(args.folder, args.port)
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
