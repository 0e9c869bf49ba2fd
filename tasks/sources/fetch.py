"""Read one media object wherever it lives: a key under the source, an s3:// URI, an http(s)
URL (the multi-image example fetches URLs) or a local path. The readers of formats whose items
name media by location (files, groups, manifests, Parquet URL columns, path lists) read through it."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from urllib.parse import urlparse

from vlm_caption.tasks.settings import get_settings
from vlm_caption.tasks.sources.items import ObjectRef
from vlm_caption.tasks.sources.storage import Storage, shared_s3_storage


class TooLargeError(ValueError):
    """An object is over the configured byte limit; it is not read into memory."""


class MediaFetcher:
    """Reads media by location, keys relative to `base`; shared by a prepare step's fetch threads.
    Other buckets are opened once each (one storage per bucket per process). With `keys_only`
    (a listing's objects) every key is one under `base`, whatever it looks like: a bucket's key
    `in//etc/passwd` or `in/s3://other/x` is that object, never a path on this host or elsewhere."""

    def __init__(self, base: Storage, *, keys_only: bool = False):
        self.base, self.keys_only = base, keys_only
        self._buckets: dict[str, Storage] = {}
        self._lock = threading.Lock()

    def read(self, ref: ObjectRef) -> bytes:
        key = ref.key
        if self.keys_only:
            return self.base.read(key)
        scheme = urlparse(key).scheme
        if scheme in ("http", "https"):
            return _http_get(key, get_settings().max_object_bytes)
        if scheme in ("s3", "s3a"):
            bucket, _, path = key.split("://", 1)[1].partition("/")
            return self._bucket(bucket).read(path)
        if scheme == "file":
            return Path(urlparse(key).path).read_bytes()
        if os.path.isabs(key):
            return Path(key).read_bytes()
        return self.base.read(key)

    def _bucket(self, bucket: str) -> Storage:
        with self._lock:
            if bucket not in self._buckets:
                self._buckets[bucket] = shared_s3_storage(bucket, "")  # one per bucket per process
            return self._buckets[bucket]


def _http_get(url: str, max_bytes: int) -> bytes:
    import httpx

    with httpx.stream("GET", url, follow_redirects=True, timeout=30.0) as response:
        response.raise_for_status()
        declared = int(response.headers.get("content-length") or 0)
        if declared > max_bytes:
            raise TooLargeError(f"{url}: {declared} bytes, over the limit of {max_bytes}")
        chunks, total = [], 0
        for chunk in response.iter_bytes():
            total += len(chunk)
            if total > max_bytes:
                raise TooLargeError(f"{url}: over the limit of {max_bytes} bytes")
            chunks.append(chunk)
    body = b"".join(chunks)
    if declared and len(body) != declared:
        raise OSError(f"{url}: got {len(body)} of {declared} bytes")
    return body
