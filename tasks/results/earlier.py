"""The records behind done-index rows, read back from their parts: where an item whose media are
the same bytes as a done result's takes its answer from (tasks/same_media.py)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from vlm_caption.tasks.results.done_rows import final_records, read_part_lines
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.sources.storage import Storage

PART_CACHE = 32  # parts whose final records are kept (a part is at most a shard's records)


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
                    records = final_records(read_part_lines(self.out, part))[0]
                except Exception:  # noqa: BLE001 - gone or unreadable since the load: no copy from it
                    records = []
                self.reads += 1
                self._cache[part] = records
                while len(self._cache) > PART_CACHE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(part)
            return records
