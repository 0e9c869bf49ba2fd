"""moto's S3 server, with its conditional PUTs made atomic: the loopback S3 of the bench and the
tests (`python -m vlm_caption.bench.loopback_s3 -H 127.0.0.1 -p PORT`, moto.server's own arguments).

A fan-out's partitions claim shards with `PUT If-None-Match: *` (tasks/claims.py), which S3
grants to exactly one writer. moto checks that the key is absent and then stores it, as two
steps on its request threads, so two racing writers could both be told they created the key (a
fresh CI run, 2026-11-27: 2 of 8 threads won one claim). One lock around moto's PUT handler
gives its check and store the atomicity S3 has."""

from __future__ import annotations

import functools
import threading


def serialize_puts() -> None:
    from moto.s3.responses import S3Response

    put_object = S3Response.put_object
    lock = threading.Lock()

    @functools.wraps(put_object)
    def put_object_atomically(self, *args, **kwargs):
        with lock:
            return put_object(self, *args, **kwargs)

    S3Response.put_object = put_object_atomically


if __name__ == "__main__":
    from moto.server import main

    serialize_puts()
    main()
