#!/usr/bin/env python
"""Read-only ranged-GET stub speaking just enough S3 for GET/HEAD object.
Serves one local file for any /BUCKET/KEY path, zero-copy via os.sendfile.
NOT an S3 implementation: no auth check, no PUT. Used only to see how fast the
clients are when the server is nearly free (moto is not)."""

import email.utils
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PATH = sys.argv[2] if len(sys.argv) > 2 else "/tmp/s3lab/obj256.bin"
SIZE = os.path.getsize(PATH)
MTIME = email.utils.formatdate(os.path.getmtime(PATH), usegmt=True)
FD = os.open(PATH, os.O_RDONLY)


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _hdr(self):
        rng = self.headers.get("Range")
        if rng:
            s, e = rng.split("=")[1].split("-")
            s = int(s)
            e = min(int(e) if e else SIZE - 1, SIZE - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {s}-{e}/{SIZE}")
        else:
            s, e = 0, SIZE - 1
            self.send_response(200)
        self.send_header("Content-Length", str(e - s + 1))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("ETag", '"stub-etag"')
        self.send_header("Last-Modified", MTIME)
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        return s, e - s + 1

    def do_HEAD(self):
        self._hdr()

    def do_GET(self):
        off, n = self._hdr()
        sock = self.connection.fileno()
        while n > 0:
            k = os.sendfile(sock, FD, off, n)
            off += k
            n -= k


ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer.request_queue_size = 128
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
