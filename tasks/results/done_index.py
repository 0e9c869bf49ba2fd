"""What earlier runs with the same fingerprint finished, so a rerun computes only the rest.

A result is identified by (item key, question). Before fetching, an item whose every question
is done for the same members (etag and size) is skipped; after fetching, one whose content hash
matches (re-uploaded, same bytes) is skipped too.

The index is compact so that a bucket's whole history loads fast: 24 bytes per finished result
(8-byte hashes of the result's key, of its members' signature and of its content), held in one
sorted numpy array. Each results part has a small sidecar (`part-....idx`, written just after the
part) holding those rows, so loading reads a few bytes per part instead of parsing JSON; a part
without a sidecar, or whose size no longer matches the one its sidecar was made from, is parsed.

A long history has many parts, and on an object store each sidecar is a request of its own
(1M results in parts of 64: 15,625 GETs). So once a load reads COMPACT_AFTER or more parts one
by one, it writes what it loaded as one compacted index (`index-<stamp>.vidx`: the parts it
covers, with their sizes, and their rows), and the next load reads that one object plus the
parts written since. A compacted index counts a part's rows only while that part is still there
with the same size, so deleting or rewriting a part is seen as before.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from prefect import task
from prefect.cache_policies import NONE
from pydantic import ValidationError

from tasks.observability import get_logger
from tasks.results.layout import compacted_index_key, results_prefix
from tasks.results.records import ResultRecord
from tasks.sources.items import ObjectRef, WorkItem
from tasks.sources.storage import Storage
from tasks.sources.transient import is_transient, retry_transient

ROW = np.dtype([("key", "<u8"), ("signature", "<u8"), ("sha", "<u8")])
SIDECAR_MAGIC = b"VLMIDX1\0"
SIDECAR_HEADER = struct.Struct("<8sQ")  # magic, byte size of the part it indexes
READERS = 16  # parallel sidecar reads (object stores answer many small GETs at once well)
COMPACT_MAGIC = b"VLMCIDX1"
COMPACT_HEADER = struct.Struct("<8sQ")  # magic, byte length of the JSON list of parts that follows
COMPACT_AFTER = 64  # parts read one by one that make a load write a new compacted index

Signature = tuple[tuple[str, int], ...]  # (etag, size) of each member, in order


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def result_key(key: str, question: str | None) -> int:
    return _hash64(f"{key}\x1f{question or ''}")


def signature_hash(signature: Signature) -> int:
    return _hash64(repr(tuple((etag, int(size)) for etag, size in signature)))


def content_hash(sha256: str | None) -> int:
    """64 bits standing for the object's sha256; 0 when it is unknown (matches nothing)."""
    return _hash64(sha256) if sha256 else 0


def listing_signature(item: WorkItem) -> Signature | None:
    """(etag, size) per member, or None when a member's were not listed (manifest URLs)."""
    if any(not m.etag or m.size < 0 for m in item.members):
        return None
    return tuple((m.etag, m.size) for m in item.members)


def record_signature(record: ResultRecord) -> Signature:
    members = record.members or [record]
    return tuple((m.etag, m.size) for m in members)


def index_rows(records: Iterable[ResultRecord]) -> np.ndarray:
    """The index rows of the records that are final (a retryable failure is computed again)."""
    return np.array([(result_key(r.key, r.question), signature_hash(record_signature(r)), content_hash(r.sha256))
                     for r in records if r.is_final], dtype=ROW)


def sidecar_bytes(rows: np.ndarray, part_size: int) -> bytes:
    return SIDECAR_HEADER.pack(SIDECAR_MAGIC, part_size) + rows.astype(ROW).tobytes()


def sidecar_key(part_key: str) -> str:
    return part_key.removesuffix(".jsonl") + ".idx"


class DoneIndex:
    """Finished results as one sorted array; lookups are binary searches."""

    def __init__(self, tables: Iterable[np.ndarray] = ()):
        self._set([*tables])

    def _set(self, tables: list[np.ndarray]) -> None:
        table = np.concatenate(tables) if tables else np.empty(0, ROW)
        self._table = table[np.argsort(table["key"], kind="stable")]

    def __len__(self) -> int:
        return len(self._table)

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def add(self, record: ResultRecord) -> None:
        self._set([self._table, index_rows([record])])

    def _rows(self, key: str, question: str | None) -> np.ndarray:
        wanted = np.uint64(result_key(key, question))
        keys = self._table["key"]
        return self._table[np.searchsorted(keys, wanted, "left"):np.searchsorted(keys, wanted, "right")]

    def pending_by_listing(self, item: WorkItem, questions: tuple[str, ...]) -> tuple[str, ...]:
        """The questions still to compute, judged from the listing alone (no fetch)."""
        signature = listing_signature(item)
        if signature is None:
            return questions
        wanted = np.uint64(signature_hash(signature))
        return tuple(q for q in questions if not (self._rows(item.id, q)["signature"] == wanted).any())

    def pending_mask(self, items: list[WorkItem], questions: tuple[str, ...]) -> np.ndarray:
        """For each item, whether a question of it is still to compute judged from the listing
        alone: `pending_by_listing` over a batch at once (the lookups vectorised), so that a
        listing of millions of done items is filtered in seconds (flows/pipeline.py)."""
        asked = [item.questions or questions for item in items]
        owners, keys, signatures = [], [], []
        unlisted = np.zeros(len(items), bool)  # a member's etag or size unknown: always pending
        for i, (item, wanted) in enumerate(zip(items, asked)):
            signature = listing_signature(item)
            if signature is None:
                unlisted[i] = True
                continue
            signed = signature_hash(signature)
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
        lo = np.searchsorted(table_keys, wanted_keys, "left")
        hi = np.searchsorted(table_keys, wanted_keys, "right")
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
        if sha256 is None:
            return questions
        wanted = np.uint64(content_hash(sha256))
        return tuple(q for q in questions if not (self._rows(item_id, q)["sha"] == wanted).any())


@task(name="load-done-index", cache_policy=NONE, persist_result=False, retries=2)
def load_done_index(out: Storage, fingerprint: str) -> DoneIndex:
    """Results that earlier runs with this fingerprint finished for good (captioned, or failed
    in a way a rerun would only repeat), in the output `out` (`RunPlan.output`). A part that
    cannot be parsed is skipped with a warning naming it; its items are computed again. One
    read many parts one by one writes a compacted index for the next."""
    loaded = load_part_rows(out, fingerprint)
    if loaded.read_one_by_one >= COMPACT_AFTER:
        _compact(out, fingerprint, {key: (loaded.parts[key].size, rows) for key, rows in loaded.rows.items()},
                 loaded.compacted, get_logger(fingerprint=fingerprint))
    return DoneIndex(loaded.rows.values())


def _read_compacted(out: Storage, key: str, objects: dict[str, ObjectRef], log) -> dict[str, np.ndarray]:
    """The rows of each part the compacted index covers that is still listed with the size it
    had; nothing when the index is gone (a concurrent load replaced it) or damaged."""
    try:
        data = out.read(key)
        magic, length = COMPACT_HEADER.unpack_from(data)
        if magic != COMPACT_MAGIC:
            raise ValueError("not a compacted done-index")
        covered = json.loads(data[COMPACT_HEADER.size:COMPACT_HEADER.size + length])
        table = np.frombuffer(data, ROW, offset=COMPACT_HEADER.size + length)
        if sum(count for _, _, count in covered) != len(table):
            raise ValueError("rows do not match the parts listed")
    except Exception as exc:  # noqa: BLE001 - any failure (gone, damaged, denied): the sidecars stand in
        log.warning("compacted done-index unreadable; reading the parts' sidecars", index=out.describe(key),
                    error=str(exc))
        return {}
    by_part, start = {}, 0
    for part, size, count in covered:
        listed = objects.get(part)
        if listed is not None and listed.size == size:
            by_part[part] = table[start:start + count]
        start += count
    return by_part


def compacted_bytes(parts: dict[str, tuple[int, np.ndarray]]) -> bytes:
    """One object holding every part's rows: (part key, its size, row count) as JSON, then rows."""
    covered = json.dumps([[key, size, len(rows)] for key, (size, rows) in parts.items()]).encode()
    rows = np.concatenate([rows.astype(ROW) for _, rows in parts.values()]) if parts else np.empty(0, ROW)
    return COMPACT_HEADER.pack(COMPACT_MAGIC, len(covered)) + covered + rows.tobytes()


def _compact(out: Storage, fingerprint: str, parts: dict[str, tuple[int, np.ndarray]],
             older: list[str], log) -> None:
    """Write the compacted index, then remove the ones it replaces. Best effort: the parts and
    their sidecars stay the truth, so a failure here costs the next load time, never results."""
    key = compacted_index_key(fingerprint)
    try:
        out.write(key, compacted_bytes(parts))
    except Exception as exc:  # noqa: BLE001 - an optimisation: a failed write must not fail the run
        log.warning("could not write the compacted done-index", index=out.describe(key), error=str(exc))
        return
    for stale in older:  # a load running beside this one may have removed it already
        try:
            out.delete(stale)
        except Exception as exc:  # noqa: BLE001 - left behind, it is read once more by the next load
            log.warning("could not remove a replaced done-index", index=out.describe(stale), error=str(exc))
    log.info("done-index compacted", index=out.describe(key), parts=len(parts), replaced=len(older))


def _read_sidecar(out: Storage, key: str, part_size: int) -> np.ndarray | None:
    """The sidecar's rows, or None when it is damaged or was made from a different part body."""
    try:
        data = out.read(key)
    except OSError:
        return None
    if len(data) < SIDECAR_HEADER.size or (len(data) - SIDECAR_HEADER.size) % ROW.itemsize:
        return None
    magic, size = SIDECAR_HEADER.unpack_from(data)
    if magic != SIDECAR_MAGIC or size != part_size:
        return None
    return np.frombuffer(data, ROW, offset=SIDECAR_HEADER.size).copy()


def parse_records(lines: list[str]) -> tuple[list[ResultRecord], int]:
    """The records among a results part's lines, in order, and how many non-empty lines are not records."""
    records, bad = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            records.append(ResultRecord.model_validate_json(line))
        except ValidationError:
            bad += 1
    return records, bad


def _parse_part(out: Storage, part: ObjectRef, log) -> np.ndarray | None:
    """A part's rows from its records. A read that fails transiently is tried again, then raised
    (the load is retried): skipped, its results would be computed again and written twice."""
    try:
        lines = retry_transient(lambda: out.read(part.key), out.describe(part.key)).decode("utf-8").splitlines()
    except Exception as exc:
        if is_transient(exc):
            raise
        log.warning("unreadable results part skipped", part=out.describe(part.key), error=str(exc))
        return None
    records, bad = parse_records(lines)
    if bad:
        log.warning("results part has lines that are not records; they are ignored",
                    part=out.describe(part.key), bad_lines=bad)
    return index_rows(records)


class PartRows:
    """Each part's rows, as a load reads them (the done-index, the Parquet view): `parts` every
    part listed (key: ObjectRef); `rows` each readable part's rows, in its final records' order;
    `resized` the parts whose sidecar was made from another body (cut short or rewritten by hand
    since); `compacted` the compacted indexes listed; `read_one_by_one` the parts none covered."""

    def __init__(self, parts: dict[str, ObjectRef], rows: dict[str, np.ndarray], resized: set[str],
                 compacted: list[str], read_one_by_one: int):
        self.parts, self.rows, self.resized = parts, rows, resized
        self.compacted, self.read_one_by_one = compacted, read_one_by_one


def load_part_rows(out: Storage, fingerprint: str) -> PartRows:
    """The latest compacted index, then the sidecars (or, where none fits, the records) of the
    parts it does not cover, kept per part; it writes no compacted index."""
    objects = {ref.key: ref for ref in out.iter_objects(prefix=results_prefix(fingerprint))}
    parts = {key: ref for key, ref in objects.items() if key.endswith(".jsonl")}
    log = get_logger(fingerprint=fingerprint)
    compacted = sorted(key for key in objects if key.endswith(".vidx"))
    by_part = _read_compacted(out, compacted[-1], objects, log) if compacted else {}
    resized: set[str] = set()

    def rows_of(part: ObjectRef) -> np.ndarray | None:
        if sidecar_key(part.key) in objects:
            rows = _read_sidecar(out, sidecar_key(part.key), part.size)
            if rows is not None:
                return rows
            resized.add(part.key)
        return _parse_part(out, part, log)

    rest = [part for key, part in parts.items() if key not in by_part]
    with ThreadPoolExecutor(READERS) as pool:
        read = list(pool.map(rows_of, rest))
    # A part that could not be read stays out of the compacted index: the next load tries it again.
    by_part.update((part.key, rows) for part, rows in zip(rest, read) if rows is not None)
    return PartRows(parts, by_part, resized, compacted, len(rest))
