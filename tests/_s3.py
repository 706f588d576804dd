"""A real S3-compatible server for the object-storage tests: moto's, started on 127.0.0.1
in a process of its own (pinned in the dev extra), and a bucket per test.

`Server` starts it on a free port and stops it; `environment` gives the variables a
client (obstore, in a test or in a subprocess) reads to reach it. Buckets are made with
one plain HTTP request (moto accepts unsigned ones). `Proxy` stands between the client and
the server to inject faults through the real HTTP path.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable


def kept(url: str) -> list[str]:
    """The keys that a save to `url` (``s3://bucket/run/model.safetensors``) keeps beside
    the checkpoint it commits: its record of the previous checkpoint's objects
    (``.model.safetensors.previous.json``), when there is one, and those of them that
    exist; sorted."""
    import json

    import obstore
    from obstore.store import from_url

    bucket, _, key = url.removeprefix("s3://").partition("/")
    folder, _, name = key.rpartition("/")
    prefix = f"{folder}/" if folder else ""
    store = from_url(f"s3://{bucket}")
    present = {m["path"] for m in obstore.list(store, folder or None).collect()}
    record = f"{prefix}.{name}.previous.json"
    if record not in present:
        return []
    named = json.loads(bytes(obstore.get(store, record).bytes()))["previous"]
    return sorted([record, *(f"{prefix}{n}" for n in named if f"{prefix}{n}" in present)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """moto's S3 server, in a process of its own on 127.0.0.1."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # (a file: a full pipe would block the server)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(64 << 20)},
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/", timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    said = self.log.read().decode(errors="replace")[-3000:]
                    raise RuntimeError(
                        f"moto's server did not start on {self.url}:\n{said}"
                    ) from None
                time.sleep(0.1)

    def environment(self, endpoint: str | None = None) -> dict[str, str]:
        """What a client needs to reach the server (or `endpoint`, a proxy in front of it)."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def bucket(self) -> str:
        """A new empty bucket's name."""
        name = f"b-{uuid.uuid4().hex[:16]}"
        request = urllib.request.Request(f"{self.url}/{name}", method="PUT")
        urllib.request.urlopen(request, timeout=10).close()
        return name

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


class Proxy:
    """A forwarding HTTP proxy in front of the server, on 127.0.0.1, through which faults
    reach the client by the real HTTP path: requests it answers 503 (``busy``: how many of
    the next ones), or 403 (``deny``), connections it drops without an answer (``drop``:
    how many), answers it holds back (``stall`` seconds), each to the requests ``only``
    picks (all by default; it is asked once per request); requests it holds back by what
    ``hold`` says of their method, path and headers; each request's headers
    (``headers``), and the bytes of GET bodies it
    passed (``served``)."""

    def __init__(self, target: str) -> None:
        import http.client
        import http.server
        import threading

        self.busy = self.drop = 0
        self.deny = False
        self.only: Callable[[str, str], bool] = lambda method, path: True  # faulted requests
        self.stall = 0.0
        # how long to hold back a request, by its method, path and headers (their names in
        # lower case), beside `stall`: seconds, or an Event to wait for (at most 60 s)
        self.hold: Callable[[str, str, dict[str, str]], float | threading.Event] = (
            lambda method, path, headers: 0.0
        )
        self.served = 0
        self.requests: list[tuple[str, str]] = []
        self.headers: list[dict[str, str]] = []  # each request's (names in lower case)
        self.lock = threading.Lock()
        host, port = target.removeprefix("http://").split(":")
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if "chunked" in self.headers.get("Transfer-Encoding", ""):
                    pieces = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        pieces.append(self.rfile.read(size))
                        self.rfile.readline()
                    self.rfile.readline()
                    body = b"".join(pieces)
                headers = dict(self.headers.items())
                named = {k.lower(): v for k, v in headers.items()}  # (names in lower case)
                with proxy.lock:
                    proxy.requests.append((self.command, self.path))
                    proxy.headers.append(named)
                    picked = chosen = proxy.only(self.command, self.path)
                    fault = "deny" if proxy.deny and chosen else None
                    chosen = chosen and fault is None
                    if chosen and proxy.busy > 0:
                        proxy.busy -= 1
                        fault = "busy"
                    elif chosen and proxy.drop > 0:
                        proxy.drop -= 1
                        fault = "drop"
                    stall = proxy.stall if picked else 0.0
                    held = proxy.hold(self.command, self.path, named)
                if stall:
                    time.sleep(stall)
                if isinstance(held, threading.Event):
                    held.wait(60)
                elif held:
                    time.sleep(held)
                if fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None:
                    code, text = (403, "AccessDenied") if fault == "deny" else (503, "SlowDown")
                    payload = (
                        f"<Error><Code>{text}</Code><Message>{fault}</Message></Error>".encode()
                    )
                    self.send_response(code)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection(host, int(port), timeout=120)
                dropped = ("host", "transfer-encoding", "content-length")
                headers = {k: v for k, v in headers.items() if k.lower() not in dropped}
                if body is not None:
                    headers["Content-Length"] = str(len(body))
                headers["Host"] = self.headers.get("Host", f"{host}:{port}")
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                kept = ("transfer-encoding", "connection")
                if self.command != "HEAD":  # (a HEAD's length is the object's: kept)
                    kept += ("content-length",)
                    self.send_header("Content-Length", str(len(data)))
                for key, value in answer.getheaders():
                    if key.lower() not in kept:
                        self.send_header(key, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                    if self.command == "GET":
                        with proxy.lock:
                            proxy.served += len(data)
                upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(  # (a short poll: stop(), at the end of each test, waits for one)
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
