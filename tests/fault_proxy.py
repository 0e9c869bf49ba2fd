"""A fault-injecting HTTP proxy on loopback, in front of the moto S3 server: on a fraction of
requests it answers 500 InternalError or 503 SlowDown, resets the connection, stalls past the
client's read timeout, or cuts a response body short (with the full Content-Length announced).

For writes there is one more: `partial` stores the first half of a PUT's body upstream and then
resets the client's connection (a store that kept what arrived of an upload cut off mid-way),
so a half-written object really sits under the key until the client writes it again.
`methods` limits the faults to some requests (e.g. only PUTs), and `force_first` names key
fragments whose first write always gets a fault, so that rare writes (the manifest, the
compacted index, the Parquet file) are faulted in every run, not only when the dice say so."""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

KINDS = ("500", "503", "reset", "stall", "truncate")
WRITE_KINDS = ("500", "503", "reset", "stall", "partial")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class FaultProxy:
    def __init__(self, upstream: str, rate: float, stall_s: float = 2.0, seed: int = 0,
                 kinds: tuple[str, ...] = KINDS, methods: set[str] | None = None,
                 force_first: tuple[str, ...] = ()):
        target = urlparse(upstream)
        self.upstream = (target.hostname, target.port)
        self.rate, self.stall_s, self.kinds, self.methods = rate, stall_s, kinds, methods
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.injected: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.faulted_paths: Counter[str] = Counter()  # request path -> faults injected on it
        self.abandoned = 0  # answers the client no longer read (it timed out on a stall)
        self.force_first, self.forced = force_first, set()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def handle(self):
                try:
                    super().handle()
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on a stalled answer
                    with proxy.lock:
                        proxy.abandoned += 1

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy.pick(self.command, self.path)
                if fault in ("500", "503"):
                    code, name = (500, "InternalError") if fault == "500" else (503, "SlowDown")
                    payload = f"<Error><Code>{name}</Code><Message>injected</Message></Error>".encode()
                    self.send_response(code)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload if self.command != "HEAD" else b"")
                    return
                if fault == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                if fault == "partial" and len(body) > 1:
                    proxy.forward(self.command, self.path, self.headers, body[: len(body) // 2])
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                if fault == "stall":
                    time.sleep(proxy.stall_s)  # the client has given up; what follows goes nowhere
                status, headers, payload = proxy.forward(self.command, self.path, self.headers, body)
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if fault == "truncate" and len(payload) > 1:
                    self.wfile.write(payload[: len(payload) // 2])
                    self.close_connection = True
                    return
                self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def pick(self, method: str, path: str = "") -> str | None:
        with self.lock:
            self.requests[method] += 1
            if self.methods is not None and method not in self.methods:
                return None
            forced = method == "PUT" and next((f for f in self.force_first if f in path and f not in self.forced), None)
            if forced:
                self.forced.add(forced)
            elif self.rng.random() >= self.rate:
                return None
            kind = self.rng.choice(self.kinds)
            self.injected[kind] += 1
            self.faulted_paths[path.split("?", 1)[0]] += 1
            return kind

    def forward(self, method, path, headers, body):
        connection = http.client.HTTPConnection(*self.upstream, timeout=30)
        headers = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}
        if body:  # the length of what is sent (a `partial` write sends less than the client did)
            headers = {k: v for k, v in headers.items() if k.lower() != "content-length"}
            headers["Content-Length"] = str(len(body))
        try:
            connection.request(method, path, body=body or None, headers=headers)
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def close(self) -> None:
        self.server.shutdown()
