"""The done-index's rows as they are stored: how a final record becomes a row, the formats of a
part's sidecar (`part-....idx`) and of a compacted index (`index-<stamp>.vidx`), and reading each
part's rows (the done-index, tasks/results/done_index.py, and the Parquet view read them).

A row is 24 bytes: 8-byte hashes of the result's key (item and question), of its members'
listed (etag, size) and of its content (sha256; 0 where it is unknown, the media not read: such
rows take part in no lookup by content). A part's rows are its final records' in the order they
stand in the part, so row i of a part is its i-th final record (what tasks/results/earlier.py
reads back to copy an answer).
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
from pydantic import ValidationError

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.results.layout import compacted_index_prefix, compacted_index_written, part_prefix, results_prefix
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.writing_log import grace_stamp, writers_since
from vlm_caption.tasks.sources.items import ObjectRef, WorkItem
from vlm_caption.tasks.sources.storage import Storage
from vlm_caption.tasks.sources.transient import is_transient, retry_transient

ROW = np.dtype([("key", "<u8"), ("signature", "<u8"), ("sha", "<u8")])
SIDECAR_MAGIC = b"VLMIDX1\0"
SIDECAR_HEADER = struct.Struct("<8sQ")  # magic, byte size of the part it indexes
READERS = 16  # parallel sidecar reads (object stores answer many small GETs at once well)
COMPACT_MAGIC = b"VLMCIDX2"
COMPACT_HEADER = struct.Struct("<8sQ")  # magic, byte length of the JSON list of parts that follows
_EXTRA = struct.Struct("<Q")  # then the byte length of the JSON of `after`, `retry`, `lineage`; then the rows

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


class Compacted(NamedTuple):
    """A compacted index as read: `parts` (key, size, rows), and what `compacted_bytes` says of the rest."""

    parts: list[tuple[str, int, np.ndarray]]
    after: str
    retry: list[str]
    lineage: list[str]


def _read_compacted(out: Storage, key: str, log) -> Compacted | None:
    """The compacted index; None when it is gone (a concurrent load replaced it) or damaged."""
    try:
        data = out.read(key)
        magic, length = COMPACT_HEADER.unpack_from(data)
        if magic != COMPACT_MAGIC:
            raise ValueError("not a compacted done-index")
        start = COMPACT_HEADER.size + length
        covered = json.loads(data[COMPACT_HEADER.size:start])
        (extra_length,) = _EXTRA.unpack_from(data, start)
        extra = json.loads(data[start + _EXTRA.size:start + _EXTRA.size + extra_length])
        start += _EXTRA.size + extra_length
        table = np.frombuffer(data, ROW, offset=start)
        if sum(count for _, _, count in covered) != len(table):
            raise ValueError("rows do not match the parts listed")
    except Exception as exc:  # noqa: BLE001 - any failure (gone, damaged, denied): the sidecars stand in
        log.warning("compacted done-index unreadable; reading the parts' sidecars", index=out.describe(key),
                    error=str(exc))
        return None
    parts, at = [], 0
    for part, size, count in covered:
        parts.append((part, size, table[at:at + count]))
        at += count
    return Compacted(parts, extra["after"], extra["retry"], extra["lineage"])


def compacted_bytes(parts: dict[str, tuple[int, np.ndarray]], after: str | None = None,
                    retry: Iterable[str] = (), lineage: Iterable[str] = ()) -> bytes:
    """One object holding every part's rows: (part key, its size, row count) as JSON, then where
    a load goes on from (`after`, a `writing/` stamp, and the parts to `retry`) and the earlier
    indexes' write stamps (`lineage`), then the rows. `after` defaults to now less the grace: only
    for a writer that wrote every part itself."""
    covered = json.dumps([[key, size, len(rows)] for key, (size, rows) in parts.items()]).encode()
    extra = json.dumps({"after": after or grace_stamp(time.time()), "retry": sorted(retry),
                        "lineage": sorted(lineage)}).encode()
    rows = np.concatenate([rows.astype(ROW) for _, rows in parts.values()]) if parts else np.empty(0, ROW)
    return (COMPACT_HEADER.pack(COMPACT_MAGIC, len(covered)) + covered + _EXTRA.pack(len(extra)) + extra
            + rows.tobytes())


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


def final_records(lines: list[str]) -> tuple[list[ResultRecord], int]:
    """The final records among a part's lines, in order (the i-th is its done-index row i), and
    how many non-empty lines are not records."""
    records, bad = parse_records(lines)
    return [r for r in records if r.is_final], bad


def read_part_lines(out: Storage, key: str) -> list[str]:
    """A part's lines. A read that fails transiently is tried again, then raised."""
    return retry_transient(lambda: out.read(key), out.describe(key)).decode("utf-8").splitlines()


def _parse_part(out: Storage, part: ObjectRef, log) -> np.ndarray | None:
    """A part's rows from its records. A read that fails transiently is tried again, then raised
    (the load is retried): skipped, its results would be computed again and written twice."""
    try:
        lines = read_part_lines(out, part.key)
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
    part known (key: ObjectRef; a part the load did not list has the size its index recorded);
    `rows` each readable part's rows, in its final records' order; `resized` the parts whose
    sidecar was made from another body (cut short or rewritten by hand since); `compacted` the
    compacted indexes listed; `read_one_by_one` the parts none covered; `unreadable` those of
    them that could not be read; `after` where a compacted index of this load goes on from;
    `renew` whether the latest compacted index is to be replaced (damaged);
    `lineage` the write stamps of the index read and of those before it."""

    def __init__(self, parts: dict[str, ObjectRef], rows: dict[str, np.ndarray], resized: set[str],
                 compacted: list[str], read_one_by_one: int, unreadable: list[str] | None = None,
                 after: str = "", renew: bool = False, lineage: list[str] | None = None):
        self.parts, self.rows, self.resized = parts, rows, resized
        self.compacted, self.read_one_by_one = compacted, read_one_by_one
        self.unreadable, self.after, self.renew = unreadable or [], after, renew
        self.lineage = lineage or []


def listed_under(out: Storage, prefixes: Iterable[str]) -> dict[str, ObjectRef]:
    objects: dict[str, ObjectRef] = {}
    for prefix in sorted(set(prefixes)):
        objects.update((ref.key, ref) for ref in out.iter_objects(prefix=prefix))
    return objects


def read_part_rows(out: Storage, parts: list[ObjectRef], listed: Iterable[str],
                   log) -> tuple[dict[str, np.ndarray], set[str], list[str]]:
    """The rows of `parts` (from the sidecar where `listed` names one that fits, else parsed), the
    parts whose sidecar did not fit their body, and those that could not be read."""
    listed = set(listed)
    resized: set[str] = set()

    def rows_of(part: ObjectRef) -> np.ndarray | None:
        if sidecar_key(part.key) in listed:
            rows = _read_sidecar(out, sidecar_key(part.key), part.size)
            if rows is not None:
                return rows
            resized.add(part.key)
        return _parse_part(out, part, log)

    with ThreadPoolExecutor(READERS) as pool:
        read = list(pool.map(rows_of, parts))
    return ({part.key: rows for part, rows in zip(parts, read) if rows is not None}, resized,
            [part.key for part, rows in zip(parts, read) if rows is None])


def load_part_rows(out: Storage, fingerprint: str) -> PartRows:
    """The latest compacted index, then the sidecars (or, where none fits, the records) of the
    parts it does not hold, kept per part; it writes no compacted index. From an index it lists
    only the parts of the writers stamped in `writing/` since, and the parts it could not read
    (tasks/results/writing_log.py says why nothing is missed); without one (none, or damaged),
    everything."""
    started = time.time()  # before any listing: what lands after it has a later stamp
    log = get_logger(fingerprint=fingerprint)
    compacted = sorted(ref.key for ref in out.iter_objects(prefix=compacted_index_prefix(fingerprint))
                       if ref.key.endswith(".vidx"))
    index = _read_compacted(out, compacted[-1], log) if compacted else None
    by_part: dict[str, np.ndarray] = {}
    if index is None:  # no index to go on from: the whole history, listed
        objects = listed_under(out, [results_prefix(fingerprint)])
    else:
        prefixes = [part_prefix(fingerprint, writer) for writer in writers_since(out, fingerprint, index.after)]
        objects = listed_under(out, prefixes + [key.removesuffix(".jsonl") for key in index.retry])
        for key, size, rows in index.parts:
            listed = objects.get(key)
            if listed is None and not any(key.startswith(prefix) for prefix in prefixes):
                objects[key] = ObjectRef(key, size, "")  # its writer wrote nothing since: as the index has it
                by_part[key] = rows
            elif listed is not None and listed.size == size:
                by_part[key] = rows
            # else: gone, or another size: read again below
    parts = {key: ref for key, ref in objects.items() if key.endswith(".jsonl")}
    rest = [part for key, part in parts.items() if key not in by_part]
    read, resized, unreadable = read_part_rows(out, rest, objects.keys(), log)
    by_part.update(read)  # a part that could not be read stays out: the next load tries it again
    lineage = [*index.lineage, compacted_index_written(fingerprint, compacted[-1])] if index is not None else []
    return PartRows(parts, by_part, resized, compacted, len(rest), unreadable, grace_stamp(started),
                    renew=bool(compacted) and index is None, lineage=lineage)
