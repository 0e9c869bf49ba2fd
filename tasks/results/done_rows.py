"""The done-index's rows (24 bytes: 8-byte hashes of the result's key, of its members' listed
(etag, size), and of its content, 0 where unknown), and where a load reads them from (`load_rows`;
docs/architecture.md, "Resume state stays small")."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
from pydantic import ValidationError

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.layout import (PARQUET_VIEW_PREFIX, VIEW_HASHES, part_prefix, results_prefix,
                                              view_owed_prefix)
from vlm_caption.tasks.sources.items import ObjectRef, WorkItem
from vlm_caption.tasks.sources.storage import Storage, open_seekable
from vlm_caption.tasks.sources.s3_client import is_transient, retry_transient

ROW = np.dtype([("key", "<u8"), ("signature", "<u8"), ("sha", "<u8")])
READERS = 16  # parallel reads (object stores answer many small GETs at once well)

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


def record_row(record: ResultRecord) -> tuple[int, int, int]:
    return (result_key(record.key, record.question), signature_hash(record_signature(record)),
            content_hash(record.sha256))


def index_rows(records: Iterable[ResultRecord]) -> np.ndarray:
    """The index rows of the records that are final (a retryable failure is computed again)."""
    return np.array([record_row(r) for r in records if r.is_final], dtype=ROW)


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
    """The final records among a part's lines, in order (the i-th is its done-index row i), and how
    many non-empty lines are not records."""
    records, bad = parse_records(lines)
    return [r for r in records if r.is_final], bad


def read_part_lines(out: Storage, key: str) -> list[str]:
    """A part's lines. A read that fails transiently is tried again, then raised."""
    return retry_transient(lambda: out.read(key), out.describe(key)).decode("utf-8").splitlines()


def _parse_part(out: Storage, part: ObjectRef, log) -> np.ndarray | None:
    """A part's rows from its records. A transient failure is raised (the load is retried):
    skipped, its results would be computed again and written twice."""
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


def read_part_rows(out: Storage, parts: list[ObjectRef], log) -> tuple[dict[str, np.ndarray], list[str]]:
    """The rows of `parts`, parsed side by side, and the parts that could not be read."""
    with ThreadPoolExecutor(READERS) as pool:
        read = list(pool.map(lambda part: _parse_part(out, part, log), parts))
    return ({part.key: rows for part, rows in zip(parts, read) if rows is not None},
            [part.key for part, rows in zip(parts, read) if rows is None])


def listed_under(out: Storage, prefixes: Iterable[str]) -> dict[str, ObjectRef]:
    objects: dict[str, ObjectRef] = {}
    for prefix in sorted(set(prefixes)):
        objects.update((ref.key, ref) for ref in out.iter_objects(prefix=prefix))
    return objects


def view_files(out: Storage) -> list[ObjectRef]:
    """The view's files (the .parquet files directly under parquet/): compacted ones, then the
    runs', each by name (its stamp)."""
    files = [ref for ref in out.iter_objects(prefix=PARQUET_VIEW_PREFIX)
             if ref.key.endswith(".parquet") and "/" not in ref.key.removeprefix(PARQUET_VIEW_PREFIX)]
    return sorted(files, key=lambda ref: (not ref.key.removeprefix(PARQUET_VIEW_PREFIX).startswith("compacted-"),
                                          ref.key))


def view_file_rows(out: Storage, ref: ObjectRef, fingerprint: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """A view file's rows of `fingerprint`, which rows of the file they are (None: all), and the
    first row of each of its row groups; read from the fingerprint and hash columns of the row
    groups whose statistics may hold the fingerprint (ranged reads on S3)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    with open_seekable(out, ref.key, ref.size) as raw:
        source = pq.ParquetFile(raw)
        meta, position = source.metadata, source.schema_arrow.get_field_index("fingerprint")
        columns = ["fingerprint", *VIEW_HASHES] if set(VIEW_HASHES) <= set(source.schema_arrow.names) else None
        starts = np.cumsum([0] + [meta.row_group(group).num_rows for group in range(meta.num_row_groups)])
        rows, ordinals = [], []
        for group in range(meta.num_row_groups):
            stats = meta.row_group(group).column(position).statistics
            if stats is None or not stats.has_min_max or stats.min <= fingerprint <= stats.max:
                table = source.read_row_group(group, columns=columns)
                mine = np.flatnonzero(pc.equal(table["fingerprint"], fingerprint).fill_null(False).to_numpy(
                    zero_copy_only=False))
                rows.append(table_rows(table)[mine])
                ordinals.append((mine + starts[group]).astype(np.uint32))
    at = np.concatenate(ordinals) if ordinals else np.empty(0, np.uint32)
    return (np.concatenate(rows) if rows else np.empty(0, ROW), None if len(at) == meta.num_rows else at,
            starts[:-1])


def table_rows(table) -> np.ndarray:
    """A view table's done-index rows: its hash columns, or, in a file written before it had
    them, the same made from its key, question, members, etag, size and sha256 columns."""
    rows = np.empty(len(table), ROW)
    if set(VIEW_HASHES) <= set(table.column_names):
        for field, column in zip(ROW.names, VIEW_HASHES):
            rows[field] = table[column].to_numpy(zero_copy_only=False)
        return rows
    columns = [table[name].to_pylist() for name in ("key", "question", "members", "etag", "size", "sha256")]
    for i, (key, question, members, etag, size, sha256) in enumerate(zip(*columns)):
        signature = tuple((m["etag"], m["size"]) for m in json.loads(members)) if members else ((etag, size),)
        rows[i] = (result_key(key, question), signature_hash(signature), content_hash(sha256))
    return rows


class Source(NamedTuple):
    """Rows read from one object: a part (row i is its i-th final record) or a view file of
    `size` bytes whose row groups begin at rows `starts` (row i is the file's row `at[i]`, or i)."""

    key: str
    rows: np.ndarray
    at: np.ndarray | None = None
    starts: np.ndarray | None = None  # None: a part
    size: int = 0


class LoadedRows(NamedTuple):
    """What a load read: its sources, and the parts it could not read (their items are computed again)."""

    sources: list[Source]
    unreadable: list[str]


def load_rows(out: Storage, fingerprint: str) -> LoadedRows:
    """The rows of `fingerprint`'s final results: the view's, and the parts of the runs it still
    owes a file; or, where the view holds none, every part's."""
    log = get_logger(fingerprint=fingerprint)
    owed_prefix = view_owed_prefix(fingerprint)
    # The marks before the files: a run writes its file before it removes its mark, so a load
    # sees one or the other, never neither.
    owed = [ref.key[len(owed_prefix):] for ref in out.iter_objects(prefix=owed_prefix)]
    files = view_files(out)
    with ThreadPoolExecutor(READERS) as pool:
        read = list(pool.map(lambda ref: view_file_rows(out, ref, fingerprint), files))
    sources = [Source(ref.key, rows, at, starts, ref.size) for ref, (rows, at, starts) in zip(files, read) if len(rows)]
    prefixes = [part_prefix(fingerprint, run) for run in owed] if sources else [results_prefix(fingerprint)]
    parts = [ref for key, ref in listed_under(out, prefixes).items()
             if key.endswith(".jsonl") and key.count("/") == 2]
    by_part, unreadable = read_part_rows(out, parts, log)
    sources += [Source(key, rows) for key, rows in by_part.items()]
    return LoadedRows(sources, unreadable)
