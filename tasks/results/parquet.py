"""Results as Parquet rows: the schema (of a shard's part and of the view's files alike), a
record's row and back, which rows are each result's latest (`latest_rows`), the writes, and the
one-file export (`vlm-caption export OUTPUT --to PATH`); the view under <output>/parquet/ is
parquet_view.py. Memory: one row group of ROW_GROUP_ROWS, plus 24 bytes per result.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.results.done_rows import (ROW, record_row, result_key, table_rows, view_files,
                                                view_parts)
from vlm_caption.tasks.results.layout import PARQUET_VIEW_PREFIX, RETRYABLE, VIEW_HASHES
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.sources.items import ObjectRef
from vlm_caption.tasks.sources.storage import Storage

ROW_GROUP_ROWS = 8192
TIMING_KEYS = ("fetch_s", "decode_s", "generate_s")
STAMP_IN_NAME = re.compile(r"(?P<stamp>\d{8}T\d{6})")  # a run id's UTC stamp

# Record fields with a column of their own: of the same name (_SAME), or made from them. Every
# other field of ResultRecord (e.g. `structured`) becomes a string column: the value as it is when
# a string, else as JSON.
_SAME = ("key", "question", "model", "recipe", "run_id", "fingerprint", "finish_reason", "prompt_tokens",
         "output_tokens", "prompt", "size", "etag", "sha256")
_OWN = {*_SAME, "text", "error", "timings", "members", "video"}
_EXTRA = [name for name in ResultRecord.model_fields if name not in _OWN]


def results_schema():
    import pyarrow as pa

    return pa.schema([
        ("key", pa.string()), ("source", pa.string()), ("question", pa.string()), ("caption", pa.string()),
        ("error_kind", pa.string()), ("error_message", pa.string()), (RETRYABLE, pa.bool_()),
        ("model", pa.string()), ("recipe", pa.string()), ("run_id", pa.string()), ("fingerprint", pa.string()),
        ("finish_reason", pa.string()), ("prompt_tokens", pa.int64()), ("output_tokens", pa.int64()),
        ("timings", pa.struct([(name, pa.float64()) for name in TIMING_KEYS])),
        ("prompt", pa.string()), ("size", pa.int64()), ("etag", pa.string()), ("sha256", pa.string()),
        ("members", pa.string()), ("video", pa.string()),  # JSON
        *[(name, pa.string()) for name in _EXTRA],
        *[(name, pa.uint64()) for name in VIEW_HASHES],
    ])


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False, default=str)


def view_row(record: ResultRecord, source: str | None) -> dict[str, Any]:
    error = record.error or {}
    row = {name: getattr(record, name) for name in _SAME}
    row.update(source=source, caption=record.text, error_kind=error.get("kind"), error_message=error.get("message"),
               timings={name: record.timings.get(name) for name in TIMING_KEYS}, video=_json(record.video),
               members=_json([m.model_dump() for m in record.members] if record.members else None))
    row[RETRYABLE] = error.get("retryable", False) if error else None
    for name in _EXTRA:
        value = getattr(record, name, None)
        row[name] = value if value is None or isinstance(value, str) else _json(value)
    row.update(zip(VIEW_HASHES, record_row(record)))
    return row


def record_from_row(row: dict[str, Any]) -> ResultRecord:
    """The record a row was made from (`view_row`): every field but a string-valued `structured`
    that reads as JSON."""
    fields = {name: row.get(name) for name in _EXTRA}
    for name, value in fields.items():
        if isinstance(value, str) and ResultRecord.model_fields[name].annotation != (str | None):
            with contextlib.suppress(ValueError):
                fields[name] = json.loads(value)
    fields.update({name: row[name] for name in _SAME}, prompt_tokens=row["prompt_tokens"] or 0,
                  output_tokens=row["output_tokens"] or 0)
    error = {"kind": row["error_kind"], "message": row["error_message"],
             "retryable": bool(row.get(RETRYABLE))} if row.get("error_kind") else None
    return ResultRecord(
        text=row["caption"], error=error, members=json.loads(row["members"]) if row.get("members") else None,
        video=json.loads(row["video"]) if row.get("video") else None,
        timings={k: v for k, v in (row.get("timings") or {}).items() if v is not None}, **fields)


def read_records(out: Storage, key: str) -> list[ResultRecord]:
    """The records of a part (or a view file), in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return [record_from_row(row) for row in pq.read_table(pa.BufferReader(out.read(key))).to_pylist()]


def part_order(part: ObjectRef) -> tuple[str, str]:
    """Parts sort by their run's UTC stamp (`part-<8 hex>-<stamp>[-pN]-<shard>.parquet`), then name."""
    found = STAMP_IN_NAME.search(part.key.rsplit("/", 1)[-1])
    return (found.group(1) if found else "", part.key)


def latest_ordinals(keyed: list[np.ndarray], stamps: list[np.ndarray]) -> list[np.ndarray]:
    """Given each file's result keys in row order (files oldest first) and a stamp per row, the
    ordinals in each file of the results that are the latest: a key's row with the latest stamp,
    then in the newest file holding it, then the last there."""
    if not keyed:
        return []
    key = np.concatenate([k.astype(np.uint64) for k in keyed])
    rank = np.concatenate([np.full(len(k), i, np.uint32) for i, k in enumerate(keyed)])
    ordinal = np.concatenate([np.arange(len(k), dtype=np.uint32) for k in keyed])
    order = np.lexsort((ordinal, rank, np.concatenate(stamps), key))  # by key, then oldest to newest
    key, rank, ordinal = key[order], rank[order], ordinal[order]
    last = np.ones(len(key), bool)
    last[:-1] = key[1:] != key[:-1]
    rank, ordinal = rank[last], ordinal[last]
    return [np.sort(ordinal[rank == i]) for i in range(len(keyed))]


class Latest(NamedTuple):
    """Of files read oldest first: each file's rows that are their result's latest final record,
    the done-index keys of those rows (all files together), the files that could not be read, and
    the final rows left out as older records of a result."""

    wanted: list[np.ndarray]
    done_keys: np.ndarray
    unreadable: dict[str, str]
    dropped: int


def latest_rows(out: Storage, files: list[ObjectRef]) -> Latest:
    """Each result (fingerprint, item key, question) once, the latest: its row in the newest run
    (the run id's stamp), then the later file, then the later row. A part's retryable failures are
    left out. Memory: 24 bytes a row."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    hashes, stamps, eligible, done_keys, unreadable = [], [], [], [], {}
    for ref in files:
        try:
            data = pa.BufferReader(out.read(ref.key))
            names = pq.ParquetFile(data).schema_arrow.names
            table = pq.read_table(data, columns=[
                name for name in ("fingerprint", "key", "question", "run_id", RETRYABLE, "done_key") if name in names])
        except Exception as exc:  # noqa: BLE001 - named in the report; its rows are left out
            unreadable[out.describe(ref.key)] = f"unreadable: {type(exc).__name__}: {exc}"
            table = results_schema().empty_table().select(["fingerprint", "key", "question", "run_id"])
        final = np.ones(len(table), bool)
        if RETRYABLE in table.column_names:
            final = ~pc.fill_null(table[RETRYABLE], False).to_numpy(zero_copy_only=False)
        table = table.filter(pa.array(final))
        eligible.append(np.flatnonzero(final).astype(np.uint32))
        hashes.append(np.fromiter((result_key(f"{fp}\x1f{key}", question) for fp, key, question in zip(
            table["fingerprint"].to_pylist(), table["key"].to_pylist(), table["question"].to_pylist())),
            np.uint64, len(table)))
        stamp = pc.struct_field(pc.extract_regex(pc.fill_null(table["run_id"], ""), STAMP_IN_NAME.pattern), [0])
        stamps.append(pc.fill_null(pc.cast(pc.replace_substring(stamp, "T", ""), pa.int64()), 0).to_numpy())
        done_keys.append(table["done_key"].to_numpy(zero_copy_only=False) if "done_key" in table.column_names
                         else np.zeros(len(table), np.uint64))
    keep = latest_ordinals(hashes, stamps)
    return Latest([rows[wanted] for rows, wanted in zip(eligible, keep)],
                  np.concatenate([keys[wanted] for keys, wanted in zip(done_keys, keep)] or [np.empty(0, np.uint64)]),
                  unreadable, sum(map(len, hashes)) - sum(map(len, keep)))


def part_bytes(rows: list[dict[str, Any]]) -> bytes:
    """A shard's part: its rows as one Parquet file, in memory (a shard is small)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=results_schema()), buffer, compression="zstd")
    return buffer.getvalue()


def write_rows(target: Storage, key: str, batches: Iterable, *, row_group_rows: int = ROW_GROUP_ROWS,
               empty_too: bool = True) -> tuple[int, int]:
    """Write the batches (lists of rows, or tables of the export's schema) as one Parquet file in
    row groups of `row_group_rows` (small batches gathered), in a local temporary file put in
    place with one atomic write (readers see the old file or the new one); the rows and row
    groups written. With empty_too=False, no rows write nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = results_schema()
    rows = groups = 0
    with tempfile.TemporaryDirectory(prefix="vlm-caption-parquet-") as tmp:
        path = Path(tmp) / "results.parquet"
        with pq.ParquetWriter(path, schema, compression="zstd") as writer:
            pending = schema.empty_table()  # rows not yet in a row group
            for batch in batches:
                table = batch if isinstance(batch, pa.Table) else pa.Table.from_pylist(batch, schema=schema)
                pending, rows = pa.concat_tables([pending, table]), rows + len(table)
                while len(pending) >= row_group_rows:
                    writer.write_table(pending.slice(0, row_group_rows))
                    pending, groups = pending.slice(row_group_rows), groups + 1
            if len(pending):
                writer.write_table(pending)
                groups += 1
        if rows or empty_too:
            target.write(key, path.read_bytes())
    return rows, groups


def finished(report: dict, started: float, **fields: Any) -> dict:
    """An export's result: `fields`, `complete` (no file skipped), the seconds since `started`,
    and the report's entries that are not empty."""
    return {**fields, "complete": not report.get("skipped"), "seconds": round(time.perf_counter() - started, 3),
            **{k: v for k, v in report.items() if v}}


def kept_rows(source, keep: np.ndarray) -> Iterator:
    """The rows of ParquetFile `source` whose indexes are in sorted `keep`, as tables in the
    results' schema, row group by row group (memory: one row group)."""
    import pyarrow as pa

    schema, start = results_schema(), 0
    for index in range(source.num_row_groups):
        count = source.metadata.row_group(index).num_rows
        wanted = keep[np.searchsorted(keep, start):np.searchsorted(keep, start + count)] - start
        start += count
        if not len(wanted):
            continue
        table = source.read_row_group(index)
        if not table.schema.equals(schema):
            # Written before a column existed (the hash columns among them): it gets it, made from
            # its other columns, or empty.
            rows = table_rows(table)
            made = {column: pa.array(rows[name]) for column, name in zip(VIEW_HASHES, ROW.names)}
            table = pa.table([table[field.name] if field.name in table.column_names else
                              made.get(field.name, pa.nulls(len(table), field.type)) for field in schema],
                             schema=schema)
        yield table if len(wanted) == count else table.take(pa.array(wanted))


def chosen_tables(out: Storage, files: list[ObjectRef], wanted: list[np.ndarray]) -> Iterator:
    """The rows `wanted` of each file, as tables of the results' schema."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for ref, rows in zip(files, wanted):
        if len(rows):
            yield from kept_rows(pq.ParquetFile(pa.BufferReader(out.read(ref.key))), rows)


def merge_files(out: Storage, files: list[ObjectRef], target: Storage, key: str, *,
                row_group_rows: int = ROW_GROUP_ROWS) -> dict:
    """Write the final results of `files` (oldest first), each once, the latest, as one Parquet
    file `key` in `target`; a report: where, rows, row groups, seconds, the files skipped."""
    started = time.perf_counter()
    latest = latest_rows(out, files)
    rows, groups = write_rows(target, key, chosen_tables(out, files, latest.wanted), row_group_rows=row_group_rows)
    return finished({"skipped": latest.unreadable}, started, path=target.describe(key), rows=rows, row_groups=groups,
                    duplicates_dropped=latest.dropped)


def export_parquet(out: Storage, target: Storage, target_key: str, *,
                   row_group_rows: int = ROW_GROUP_ROWS) -> dict:
    """Write the output `out`'s final results (the view's files and the parts not folded into
    them, every fingerprint; each result once, the latest) as one Parquet file, `target_key` in
    `target`, and return `merge_files`'s report."""
    listed = list(out.iter_objects(prefix=PARQUET_VIEW_PREFIX))
    result = merge_files(out, view_files(listed) + sorted(view_parts(listed), key=part_order), target, target_key,
                         row_group_rows=row_group_rows)
    log = get_logger()
    if result["complete"]:
        log.info("results exported as Parquet", path=result["path"], rows=result["rows"])
    else:
        log.warning("results exported as Parquet without some files", path=result["path"], rows=result["rows"],
                    skipped=list(result["skipped"]))
    return result
