"""A storage that records what a test's code lists (the prefixes) and reads (the keys): what the
tests of 'a night reads only what is new' assert on."""

from __future__ import annotations


class RecordingStorage:
    def __init__(self, inner):
        self.inner, self.listed, self.reads = inner, [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def iter_objects(self, glob=None, prefix="", start_after=""):
        self.listed.append(prefix)
        return self.inner.iter_objects(glob, prefix, start_after)

    def read(self, key: str) -> bytes:
        self.reads.append(key)
        return self.inner.read(key)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        self.reads.append(key)
        return self.inner.read_range(key, start, length)
