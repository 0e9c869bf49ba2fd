"""Answers an earlier run (or an earlier shard of this run) already made for the same media, read
back from its results part: what lets an item that is a copy of a done result take that answer
with no engine request (the done-index finds the row, tasks/results/done_index.py; this reads the
record behind it).

Two ways to know two items' media are the same bytes:
- by content: the fetched bytes' sha256 (a group's hash of its members', in order);
- by listing, before any fetch: every member's listed ETag is the object's MD5 (S3 and most
  S3-compatible stores give a single-part upload's MD5 as its ETag, 32 hex digits; a multipart
  upload's has a '-', a folder's is its size and mtime, a tar member's or a Parquet cell's names
  its file, none of which is a content hash), so equal (ETag, size) lists mean equal bytes. A
  group is a copy only when all its members are, in order.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

import numpy as np

from tasks.results.done_rows import Signature, listing_signature, parse_records, read_part_lines
from tasks.results.records import GenerationOutput, ResultRecord
from tasks.sources.items import WorkItem
from tasks.sources.storage import Storage

MD5 = re.compile(r"[0-9a-f]{32}")
PART_CACHE = 32  # parts whose final records are kept (a part is at most a shard's records)


def content_signature(item: WorkItem) -> Signature | None:
    """The listed (ETag, size) of each member where every ETag is the object's MD5, else None."""
    signature = listing_signature(item)
    if signature is None or not all(MD5.fullmatch(etag.lower()) for etag, _ in signature):
        return None
    return signature


def copied_output(record: ResultRecord, keep_prompt: bool) -> GenerationOutput:
    """An earlier record's answer, as the engine gave it (a generate prompt is rendered again)."""
    return GenerationOutput(record.text, record.finish_reason, record.prompt_tokens, record.output_tokens,
                            prompt=record.prompt if keep_prompt else None)


def original_key(record: ResultRecord) -> str:
    """The key of the item that was captioned: a copy's record names the one it took its answer from."""
    return record.duplicate_of or record.key


class EarlierRecords:
    """The records behind done-index rows: row `ordinal` of the rows loaded part after part is
    final record `ordinal - starts[p]` of part `p`. A part is read once while among the
    PART_CACHE parts read last, so a rerun with many copies of one earlier shard reads it once."""

    def __init__(self, out: Storage, parts: list[str], starts: np.ndarray):
        self.out, self.parts, self.starts = out, parts, starts
        self._cache: OrderedDict[str, list[ResultRecord]] = OrderedDict()
        self._lock = threading.Lock()
        self.reads = 0

    def record(self, ordinal: int) -> ResultRecord | None:
        p = int(np.searchsorted(self.starts, ordinal, "right")) - 1
        if p < 0 or p >= len(self.parts):
            return None
        records = self._final_records(self.parts[p])
        row = ordinal - int(self.starts[p])
        return records[row] if row < len(records) else None

    def _final_records(self, part: str) -> list[ResultRecord]:
        with self._lock:  # one read of a part however many fetch threads ask for it at once
            records = self._cache.get(part)
            if records is None:
                try:
                    records = [r for r in parse_records(read_part_lines(self.out, part))[0] if r.is_final]
                except Exception:  # noqa: BLE001 - gone or unreadable since the load: no copy from it
                    records = []
                self.reads += 1
                self._cache[part] = records
                while len(self._cache) > PART_CACHE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(part)
            return records
