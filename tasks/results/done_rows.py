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

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.layout import PARQUET_VIEW_PREFIX, RETRYABLE, VIEW_HASHES, parts_prefix
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


def view_files(listed: Iterable[ObjectRef]) -> list[ObjectRef]:
    """The view's files among the objects `listed` under parquet/ (the .parquet files directly
    there, not the parts in its folders): compacted ones, then the runs', each by name (its stamp)."""
    files = [ref for ref in listed
             if ref.key.endswith(".parquet") and "/" not in ref.key.removeprefix(PARQUET_VIEW_PREFIX)]
    return sorted(files, key=lambda ref: (not ref.key.removeprefix(PARQUET_VIEW_PREFIX).startswith("compacted-"),
                                          ref.key))


def view_file_rows(out: Storage, ref: ObjectRef, fingerprint: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """A view file's (or part's) rows of `fingerprint`'s final results, which rows of the file they
    are (None: all), and the first row of each of its row groups; read from the fingerprint, hash
    and retryable columns of the row groups whose statistics may hold the fingerprint (ranged
    reads on S3)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    with open_seekable(out, ref.key, ref.size) as raw:
        source = pq.ParquetFile(raw)
        meta, names = source.metadata, source.schema_arrow.names
        columns = ["fingerprint", *VIEW_HASHES] if set(VIEW_HASHES) <= set(names) else None
        if columns and RETRYABLE in names:
            columns.append(RETRYABLE)
        starts = np.cumsum([0] + [meta.row_group(group).num_rows for group in range(meta.num_row_groups)])
        rows, ordinals = [], []
        for group in may_hold(meta, names.index("fingerprint"), fingerprint):
            table = source.read_row_group(group, columns=columns)
            wanted = pc.equal(table["fingerprint"], fingerprint)
            if RETRYABLE in table.column_names:  # a part's retryable failures are computed again, never done
                wanted = pc.and_(wanted, pc.invert(pc.fill_null(table[RETRYABLE], False)))
            mine = np.flatnonzero(wanted.fill_null(False).to_numpy(zero_copy_only=False))
            rows.append(table_rows(table)[mine])
            ordinals.append((mine + starts[group]).astype(np.uint32))
    at = np.concatenate(ordinals) if ordinals else np.empty(0, np.uint32)
    return (np.concatenate(rows) if rows else np.empty(0, ROW), None if len(at) == meta.num_rows else at,
            starts[:-1])


def may_hold(meta, position: int, fingerprint: str) -> list[int]:
    """The row groups of a Parquet file (its metadata) whose statistics of column `position` (the
    fingerprint) may hold `fingerprint`."""
    groups = []
    for group in range(meta.num_row_groups):
        stats = meta.row_group(group).column(position).statistics
        if stats is None or not stats.has_min_max or stats.min <= fingerprint <= stats.max:
            groups.append(group)
    return groups


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
    """Rows read from one Parquet file (a view file or a part) of `size` bytes whose row groups
    begin at rows `starts`: row i is the file's row `at[i]` (or i, where `at` is None)."""

    key: str
    rows: np.ndarray
    at: np.ndarray | None = None
    starts: np.ndarray | None = None
    size: int = 0


class LoadedRows(NamedTuple):
    """What a load read: its sources, and the files it could not read (their items are computed again)."""

    sources: list[Source]
    unreadable: list[str]


def view_parts(listed: Iterable[ObjectRef], fingerprint: str | None = None) -> list[ObjectRef]:
    """The parts not folded into the view yet among the objects `listed` under parquet/ (the
    .parquet files in its fingerprints' folders), of every fingerprint or of `fingerprint`."""
    prefix = parts_prefix(fingerprint) if fingerprint else PARQUET_VIEW_PREFIX
    return [ref for ref in listed if ref.key.startswith(prefix) and ref.key.endswith(".parquet")
            and ref.key.count("/") == 2]


def view_and_parts(out: Storage, fingerprint: str) -> tuple[list[ObjectRef], list[ObjectRef]]:
    """The view's files (`view_files`) and `fingerprint`'s parts not folded into them yet, from
    one listing of the view."""
    listed = list(out.iter_objects(prefix=PARQUET_VIEW_PREFIX))
    return view_files(listed), view_parts(listed, fingerprint)


def load_rows(out: Storage, fingerprint: str) -> LoadedRows:
    """The rows of `fingerprint`'s final results: the view's files' and the parts not folded into
    them yet (a killed run's, a running one's). A file that cannot be read (not transiently) is
    skipped with a warning; its results are computed again."""
    log = get_logger(fingerprint=fingerprint)
    files, parts = view_and_parts(out, fingerprint)

    def read(ref: ObjectRef):
        try:
            return retry_transient(lambda: view_file_rows(out, ref, fingerprint), out.describe(ref.key))
        except Exception as exc:
            if is_transient(exc):
                raise  # skipped, its results would be computed again and written twice
            log.warning("unreadable results file skipped", file=out.describe(ref.key), error=str(exc))
            return None

    with ThreadPoolExecutor(READERS) as pool:
        read_rows = list(pool.map(read, files + parts))
    return LoadedRows([Source(ref.key, *rows, ref.size) for ref, rows in zip(files + parts, read_rows)
                       if rows is not None and len(rows[0])],
                      [ref.key for ref, rows in zip(files + parts, read_rows) if rows is None])


def has_results(out: Storage, fingerprint: str) -> bool:
    """Whether the output may hold a result of `fingerprint`: a part, or a view file (the newest
    first) with a row group whose statistics may hold it; only the files' footers are read."""
    import pyarrow.parquet as pq

    files, parts = view_and_parts(out, fingerprint)
    if parts:
        return True
    for ref in reversed(files):
        with open_seekable(out, ref.key, ref.size) as raw:
            meta = pq.ParquetFile(raw).metadata
            if may_hold(meta, meta.schema.to_arrow_schema().names.index("fingerprint"), fingerprint):
                return True
    return False
