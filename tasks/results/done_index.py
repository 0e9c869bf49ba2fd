"""What earlier runs with the same fingerprint finished (by item key and question), so a rerun
skips an item whose every question is done for the same listed etag and size or, once fetched,
the same bytes; and a copy of those bytes under another key takes the answer (`earlier_answer`;
tasks/same_media.py). Its memory: docs/architecture.md, "Resume state stays small". The run's own
load is kept for the Parquet step at its end (`loaded_index`)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable

import numpy as np
from prefect import task
from prefect.cache_policies import NONE

from vlm_caption.tasks.observability import phase
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.done_rows import (ROW, Signature, Source, _hash64, content_hash, listing_signature,
                                                load_rows, record_signature, result_key, signature_hash)
from vlm_caption.tasks.results.parquet import record_from_row
from vlm_caption.tasks.sources.items import WorkItem
from vlm_caption.tasks.sources.storage import Storage, open_seekable

MAX_CANDIDATES = 64  # earlier results with the same bytes looked at for one (item, question)
CACHED = 32  # row groups (of parts or view files) whose records are kept (each at most ROW_GROUP_ROWS)


def listed_signature_hash(item: WorkItem) -> int | None:
    """`signature_hash(listing_signature(item))`; a one-member item's (the usual case) made from
    the same text without the tuples."""
    if len(item.members) == 1:
        member = item.members[0]
        if not member.etag or member.size < 0:
            return None
        return _hash64(f"(({member.etag!r}, {int(member.size)}),)")
    signature = listing_signature(item)
    return None if signature is None else signature_hash(signature)


class DoneIndex:
    """Finished results as one sorted array; lookups are binary searches. Built from the sources
    a load read (tasks/results/done_rows.py), it can read an earlier result's record back from
    `out`; from bare row arrays it answers only whether a result is done."""

    def __init__(self, sources: Iterable[Source | np.ndarray] = (), out: Storage | None = None):
        sources = [s if isinstance(s, Source) else Source("", s) for s in sources]
        tables = [source.rows for source in sources]
        table = np.concatenate(tables) if tables else np.empty(0, ROW)
        order = np.argsort(table["key"], kind="stable")
        self._table, self._out = table[order], out
        # Which loaded row (source, its row) each sorted row is, where records can be read back.
        self._ordinal = order.astype(np.uint32) if out is not None else np.empty(0, np.uint32)
        self._sources = [s._replace(rows=np.empty(0, ROW)) for s in sources]
        self._starts = np.cumsum([0] + [len(t) for t in tables[:-1]]) if tables else np.empty(0, np.int64)
        self._by: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # column -> (sorted values, their ordinals)
        self._lock, self._reading = threading.Lock(), threading.Lock()
        # A row group is read once while among the CACHED read last, so a rerun with many copies
        # of one earlier shard reads it once.
        self._records = functools.lru_cache(CACHED)(self._read_records)
        self.reads = 0

    def __len__(self) -> int:
        return len(self._table)

    @property
    def nbytes(self) -> int:
        return self._table.nbytes + self._ordinal.nbytes + sum(v.nbytes + o.nbytes for v, o in self._by.values())

    def _rows(self, key: str, question: str | None) -> np.ndarray:
        wanted = np.uint64(result_key(key, question))
        keys = self._table["key"]
        return self._table[np.searchsorted(keys, wanted, "left"):np.searchsorted(keys, wanted, "right")]

    def _pending(self, item_id: str, questions: tuple[str, ...], column: str, value: int) -> tuple[str, ...]:
        wanted = np.uint64(value)  # the questions without a result of `item_id` whose `column` is `value`
        return tuple(q for q in questions if not (self._rows(item_id, q)[column] == wanted).any())

    def holding(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        """For result keys (`result_key`), the sources (view files, parts) holding a row of any
        of them, and which of the keys each holds (none for an index of bare rows)."""
        if self._out is None:
            return {}
        keys = np.unique(np.asarray(keys, np.uint64))
        table_keys = self._table["key"]
        lo, hi = np.searchsorted(table_keys, keys, "left"), np.searchsorted(table_keys, keys, "right")
        rows = np.concatenate([np.arange(lo[i], hi[i]) for i in np.flatnonzero(hi > lo)] or [np.empty(0, np.intp)])
        part = np.searchsorted(self._starts, self._ordinal[rows], "right") - 1
        return {self._sources[int(p)].key: np.unique(table_keys[rows[part == p]]) for p in np.unique(part)}

    def pending_by_listing(self, item: WorkItem, questions: tuple[str, ...]) -> tuple[str, ...]:
        """The questions still to compute, judged from the listing alone (no fetch)."""
        signed = listed_signature_hash(item)
        return questions if signed is None else self._pending(item.id, questions, "signature", signed)

    def pending_mask(self, items: list[WorkItem], questions: tuple[str, ...]) -> np.ndarray:
        """`pending_by_listing` over a batch at once, vectorised (a listing of millions of done
        items filtered in seconds): for each item, whether a question of it is still to compute."""
        owners, keys, signatures = [], [], []
        pending = np.zeros(len(items), bool)
        for i, item in enumerate(items):
            signed = listed_signature_hash(item)
            if signed is None:  # a member's etag or size unknown: always pending
                pending[i] = True
                continue
            for question in item.questions or questions:
                owners.append(i)
                keys.append(result_key(item.id, question))
                signatures.append(signed)
        if not keys:
            return pending
        wanted_keys = np.array(keys, np.uint64)
        wanted_signatures = np.array(signatures, np.uint64)
        table_keys = self._table["key"]
        # The batch's keys searched in sorted order: consecutive searches then probe the same rows
        # first, which a table of millions (larger than the cache) makes twice as fast.
        order = np.argsort(wanted_keys)
        lo, hi = np.empty(len(keys), np.intp), np.empty(len(keys), np.intp)
        lo[order] = np.searchsorted(table_keys, wanted_keys[order], "left")
        hi[order] = np.searchsorted(table_keys, wanted_keys[order], "right")
        done = np.zeros(len(keys), bool)
        single = (hi - lo) == 1  # the usual case: one result for this (item, question)
        done[single] = self._table["signature"][lo[single]] == wanted_signatures[single]
        for j in np.flatnonzero((hi - lo) > 1):  # several results (re-uploaded, rerun): any match
            done[j] = bool((self._table["signature"][lo[j]:hi[j]] == wanted_signatures[j]).any())
        np.logical_or.at(pending, np.array(owners), ~done)
        return pending

    def pending_by_content(self, item_id: str, sha256: str | None,
                           questions: tuple[str, ...]) -> tuple[str, ...]:
        """Of those, the ones whose result is not there for these very bytes."""
        return questions if sha256 is None else self._pending(item_id, questions, "sha", content_hash(sha256))

    def _matching(self, column: str, value: int) -> np.ndarray:
        """The ordinals of the rows whose `column` is `value` (the column sorted at its first lookup)."""
        with self._lock:
            if column not in self._by:
                order = np.argsort(self._table[column], kind="stable")
                self._by[column] = (self._table[column][order], self._ordinal[order])
            values, ordinals = self._by[column]
        wanted = np.uint64(value)
        return ordinals[np.searchsorted(values, wanted, "left"):np.searchsorted(values, wanted, "right")]

    def earlier_answer(self, question: str, *, sha256: str | None = None,
                       signature: Signature | None = None) -> ResultRecord | None:
        """A done caption of `question` about the same bytes, found by the fetched `sha256` or,
        before any fetch, by a `signature` of listed MD5 ETags (tasks/same_media.py); an item's
        own record before a copy's. None where there is none, or records cannot be read back."""
        if self._out is None or not (sha256 or signature):
            return None
        if sha256:
            found = self._matching("sha", content_hash(sha256))
            same = lambda record: record.sha256 == sha256  # noqa: E731 - the 64-bit hash confirmed
        else:
            found = self._matching("signature", signature_hash(signature))
            same = lambda record: record_signature(record) == tuple(signature)  # noqa: E731
        copy = None
        for ordinal in found[:MAX_CANDIDATES]:
            record = self._record(int(ordinal))
            if record is None or record.error is not None or record.question != question or not same(record):
                continue
            if record.duplicate_of is None:
                return record
            copy = copy or record
        return copy

    def _record(self, ordinal: int) -> ResultRecord | None:
        """The record behind loaded row `ordinal`, read back from its file's row group."""
        s = int(np.searchsorted(self._starts, ordinal, "right")) - 1
        source, row = self._sources[s], ordinal - int(self._starts[s])
        row = row if source.at is None else int(source.at[row])  # the file's row, in the row group before it
        group = int(np.searchsorted(source.starts, row, "right")) - 1
        row -= int(source.starts[group])
        with self._reading:  # one read of a source however many fetch threads ask for it at once
            records = self._records(s, group)
        return records[row] if row < len(records) else None

    def _read_records(self, s: int, group: int) -> list[ResultRecord]:
        """The records of source `s`'s row group `group`."""
        import pyarrow.parquet as pq

        self.reads += 1
        source = self._sources[s]
        try:
            with open_seekable(self._out, source.key, source.size) as raw:
                return [record_from_row(row) for row in pq.ParquetFile(raw).read_row_group(group).to_pylist()]
        except Exception:  # noqa: BLE001 - gone or unreadable since the load: no copy from it
            return []


_loaded_lock = threading.Lock()
_loaded: dict[tuple[str, str], DoneIndex] = {}  # (output, fingerprint) -> the last index loaded in this process


@task(name="load-done-index", cache_policy=NONE, persist_result=False, retries=2)
def load_done_index(out: Storage, fingerprint: str) -> DoneIndex:
    """Results that earlier runs with this fingerprint finished for good (captioned, or failed
    in a way a rerun would only repeat), in the output `out`, kept for `loaded_index`. A part
    that cannot be parsed is skipped with a warning; its items are computed again."""
    done = read_done_index(out, fingerprint)
    with _loaded_lock:
        _loaded[(out.uri, fingerprint)] = done
    return done


def read_done_index(out: Storage, fingerprint: str) -> DoneIndex:
    """`load_done_index`'s body, outside a task and keeping nothing."""
    phase("loading what earlier runs did", output=out.uri)
    return DoneIndex(load_rows(out, fingerprint).sources, out)


def loaded_index(out: Storage, fingerprint: str) -> DoneIndex | None:
    """The done-index this process last loaded for `out` and `fingerprint` (a run's, at its
    start), handed over once: the next call answers None until the next load."""
    with _loaded_lock:
        return _loaded.pop((out.uri, fingerprint), None)
