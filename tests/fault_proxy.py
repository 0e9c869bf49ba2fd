"""A fault-injecting HTTP proxy on loopback, in front of the moto S3 server: on a fraction of
requests it answers 500 InternalError or 503 SlowDown, resets the connection, stalls past the
client's read timeout, or cuts a response body short (with the full Content-Length announced)."""

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
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


class FaultProxy:
    def __init__(self, upstream: str, rate: float, stall_s: float = 2.0, seed: int = 0):
        target = urlparse(upstream)
        self.upstream = (target.hostname, target.port)
        self.rate, self.stall_s = rate, stall_s
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.injected: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy.pick(self.command)
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

    def pick(self, method: str) -> str | None:
        with self.lock:
            self.requests[method] += 1
            if self.rng.random() >= self.rate:
                return None
            kind = self.rng.choice(KINDS)
            self.injected[kind] += 1
            return kind

    def forward(self, method, path, headers, body):
        connection = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            connection.request(method, path, body=body or None,
                               headers={k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP})
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def close(self) -> None:
        self.server.shutdown()
