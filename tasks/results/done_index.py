"""What earlier runs with the same fingerprint finished, so a rerun computes only the rest, and
copies of what they finished take its answer.

A result is identified by (item key, question). Before fetching, an item whose every question
is done for the same members (etag and size) is skipped; after fetching, one whose content hash
matches (re-uploaded, same bytes) is skipped too. An item under another key whose media are the
same bytes as a done result's (its listed ETags are MD5s and equal, or its fetched sha256 is
equal) takes that result's answer (`earlier_answer`; tasks/same_media.py).

The index is compact so that a bucket's whole history loads fast: 24 bytes per finished result
(its row: tasks/results/done_rows.py, which also says where a load reads them: the Parquet
view's hash columns, and the parts of runs the view does not hold yet) held in one sorted numpy
array, plus 4 bytes per result saying which source and row it came from. The first lookup by
content or by listed ETags sorts that column once: 12 bytes more per result for each (its
values and rows), so a run with copies holds at most 52 bytes per earlier result; a run without
any holds 28.

The run's own load is kept for the Parquet step at its end (`loaded_index`): which earlier
results it replaces, and in which view file or part they stand, without reading the history again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np
from prefect import task
from prefect.cache_policies import NONE

from vlm_caption.tasks.observability import phase
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.done_rows import (ROW, Signature, Source, _hash64, content_hash, listing_signature,
                                                load_rows, record_signature, result_key, signature_hash)
from vlm_caption.tasks.results.earlier import EarlierRecords
from vlm_caption.tasks.sources.items import WorkItem
from vlm_caption.tasks.sources.storage import Storage

MAX_CANDIDATES = 64  # earlier results with the same bytes looked at for one (item, question)


def listed_signature_hash(item: WorkItem) -> int | None:
    """`signature_hash(listing_signature(item))`; a one-member item's (the usual case, once per
    listed item) from the same text, `repr(((etag, size),))`, made without the tuples."""
    if len(item.members) == 1:
        member = item.members[0]
        if not member.etag or member.size < 0:
            return None
        return _hash64(f"(({member.etag!r}, {int(member.size)}),)")
    signature = listing_signature(item)
    return None if signature is None else signature_hash(signature)


class DoneIndex:
    """Finished results as one sorted array; lookups are binary searches. Built from the rows of
    each source a load read (`sources`, tasks/results/done_rows.py), it can read an earlier
    result's record back from `out`; from bare row arrays it answers only whether a result is done."""

    def __init__(self, sources: Iterable[Source | np.ndarray] = (), out: Storage | None = None):
        sources = [s if isinstance(s, Source) else Source("", s) for s in sources]
        tables = [source.rows for source in sources]
        table = np.concatenate(tables) if tables else np.empty(0, ROW)
        order = np.argsort(table["key"], kind="stable")
        self._table = table[order]
        self._earlier: EarlierRecords | None = None
        self._ordinal = np.empty(0, np.uint32)
        if out is not None:
            self._ordinal = order.astype(np.uint32)  # which loaded row (source, its row) each sorted row is
            starts = np.cumsum([0] + [len(t) for t in tables[:-1]]) if tables else np.empty(0, np.int64)
            self._earlier = EarlierRecords(out, [s._replace(rows=np.empty(0, ROW)) for s in sources], starts)
        self._by: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # column -> (sorted values, their ordinals)
        self._lock = threading.Lock()

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
        of them, and which of the keys each holds. Empty for an index that cannot name them."""
        if self._earlier is None or not len(keys) or not len(self._table):
            return {}
        keys = np.unique(np.asarray(keys, np.uint64))
        table_keys = self._table["key"]
        lo, hi = np.searchsorted(table_keys, keys, "left"), np.searchsorted(table_keys, keys, "right")
        found = np.flatnonzero(hi > lo)
        if not len(found):
            return {}
        rows = np.concatenate([np.arange(lo[i], hi[i]) for i in found])
        part = np.searchsorted(self._earlier.starts, self._ordinal[rows], "right") - 1
        held: dict[str, np.ndarray] = {}
        for p in np.unique(part):
            held[self._earlier.sources[int(p)].key] = np.unique(table_keys[rows[part == p]])
        return held

    def pending_by_listing(self, item: WorkItem, questions: tuple[str, ...]) -> tuple[str, ...]:
        """The questions still to compute, judged from the listing alone (no fetch)."""
        signed = listed_signature_hash(item)
        return questions if signed is None else self._pending(item.id, questions, "signature", signed)

    def pending_mask(self, items: list[WorkItem], questions: tuple[str, ...]) -> np.ndarray:
        """For each item, whether a question of it is still to compute judged from the listing
        alone: `pending_by_listing` over a batch at once (the lookups vectorised), so that a
        listing of millions of done items is filtered in seconds (flows/pipeline.py)."""
        asked = [item.questions or questions for item in items]
        owners, keys, signatures = [], [], []
        unlisted = np.zeros(len(items), bool)  # a member's etag or size unknown: always pending
        for i, (item, wanted) in enumerate(zip(items, asked)):
            signed = listed_signature_hash(item)
            if signed is None:
                unlisted[i] = True
                continue
            for question in wanted:
                owners.append(i)
                keys.append(result_key(item.id, question))
                signatures.append(signed)
        pending = unlisted
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
        """A done caption of `question` about the same bytes: found by the fetched `sha256`, or
        before any fetch by a `signature` of listed ETags that are MD5s (tasks/same_media.py `content_signature`).
        The record of an item that was itself captioned is preferred to a copy's. None where there
        is none, or where this index cannot read records back."""
        if self._earlier is None or not (sha256 or signature):
            return None
        if sha256:
            found = self._matching("sha", content_hash(sha256))
            same = lambda record: record.sha256 == sha256  # noqa: E731 - the 64-bit hash confirmed
        else:
            found = self._matching("signature", signature_hash(signature))
            same = lambda record: record_signature(record) == tuple(signature)  # noqa: E731
        copy = None
        for ordinal in found[:MAX_CANDIDATES]:
            record = self._earlier.record(int(ordinal))
            if record is None or record.error is not None or record.question != question or not same(record):
                continue
            if record.duplicate_of is None:
                return record
            copy = copy or record
        return copy


_loaded_lock = threading.Lock()
_loaded: dict[tuple[str, str], DoneIndex] = {}  # (output, fingerprint) -> the last index loaded in this process


@task(name="load-done-index", cache_policy=NONE, persist_result=False, retries=2)
def load_done_index(out: Storage, fingerprint: str) -> DoneIndex:
    """Results that earlier runs with this fingerprint finished for good (captioned, or failed
    in a way a rerun would only repeat), in the output `out` (`RunPlan.output`), kept for
    `loaded_index`. A part that cannot be parsed is skipped with a warning naming it; its items
    are computed again."""
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
