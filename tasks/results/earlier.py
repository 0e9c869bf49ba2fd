"""The records behind done-index rows, read back from a part or a view file: where an item whose
media are the same bytes as a done result's takes its answer from (tasks/same_media.py)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.done_rows import Source, final_records, read_part_lines
from vlm_caption.tasks.results.parquet import view_group_records, view_group_starts
from vlm_caption.tasks.sources.storage import Storage

CACHED = 32  # parts or view row groups whose records are kept (each at most a shard's or ROW_GROUP_ROWS)


class EarlierRecords:
    """The records behind done-index rows: row `ordinal` of the rows loaded source after source
    is row `ordinal - starts[s]` of source `s` (tasks/results/done_rows.py `Source`). A part, or
    a view file's row group, is read once while among the CACHED read last, so a rerun with many
    copies of one earlier shard reads it once."""

    def __init__(self, out: Storage, sources: list[Source], starts: np.ndarray):
        self.out, self.sources, self.starts = out, sources, starts
        self._cache: OrderedDict[tuple[str, int], list] = OrderedDict()  # (key, -1 part | -2 groups | group)
        self._lock = threading.Lock()
        self.reads = 0

    def record(self, ordinal: int) -> ResultRecord | None:
        s = int(np.searchsorted(self.starts, ordinal, "right")) - 1
        if s < 0 or s >= len(self.sources):
            return None
        source, row = self.sources[s], ordinal - int(self.starts[s])
        if not source.view:
            records = self._cached((source.key, -1), lambda: final_records(read_part_lines(self.out, source.key))[0])
            return records[row] if row < len(records) else None
        at = row if source.at is None else int(source.at[row])  # the file's row, in the group starting before it
        starts = self._cached((source.key, -2), lambda: view_group_starts(self.out, source.key, source.size))
        group = int(np.searchsorted(starts, at, "right")) - 1
        if group < 0:
            return None
        records = self._cached((source.key, group),
                               lambda: view_group_records(self.out, source.key, source.size, group))
        at -= int(starts[group])  # its row within the group
        return records[at] if at < len(records) else None

    def _cached(self, name: tuple[str, int], read):
        with self._lock:  # one read of a source however many fetch threads ask for it at once
            records = self._cache.get(name)
            if records is None:
                try:
                    records = read()
                except Exception:  # noqa: BLE001 - gone or unreadable since the load: no copy from it
                    records = []
                self.reads += 1
                self._cache[name] = records
                while len(self._cache) > CACHED:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(name)
            return records
