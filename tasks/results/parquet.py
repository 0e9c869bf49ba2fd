"""An output's final results as Parquet rows: the schema, the rules (docs/results.md), and the
one-file export (`vlm-caption export OUTPUT --to PATH`); the view under <output>/parquet/ is
parquet_view.py. Memory: one part and one row group of ROW_GROUP_ROWS, plus 16 bytes per result.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.results.done_rows import final_records, read_part_rows, record_row
from vlm_caption.tasks.results.layout import VIEW_HASHES, manifest_key, run_of
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
        ("error_kind", pa.string()), ("error_message", pa.string()),
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
    for name in _EXTRA:
        value = getattr(record, name, None)
        row[name] = value if value is None or isinstance(value, str) else _json(value)
    row.update(zip(VIEW_HASHES, record_row(record)))
    return row


def record_from_row(row: dict[str, Any]) -> ResultRecord:
    """The record a view row was made from (`view_row`), as far as a copy of its answer needs it:
    every field but a string-valued `structured` that reads as JSON."""
    fields = {name: row.get(name) for name in _EXTRA}
    for name, value in fields.items():
        if isinstance(value, str) and ResultRecord.model_fields[name].annotation != (str | None):
            with contextlib.suppress(ValueError):
                fields[name] = json.loads(value)
    fields.update({name: row[name] for name in _SAME}, prompt_tokens=row["prompt_tokens"] or 0,
                  output_tokens=row["output_tokens"] or 0)
    error = {"kind": row["error_kind"], "message": row["error_message"]} if row.get("error_kind") else None
    return ResultRecord(
        text=row["caption"], error=error, members=json.loads(row["members"]) if row.get("members") else None,
        video=json.loads(row["video"]) if row.get("video") else None,
        timings={k: v for k, v in (row.get("timings") or {}).items() if v is not None}, **fields)


def part_order(part: ObjectRef) -> tuple[str, str]:
    """Parts sort by their run's UTC stamp (`part-<8 hex>-<stamp>[-pN]-<shard>.jsonl`), then name."""
    found = STAMP_IN_NAME.search(part.key.rsplit("/", 1)[-1])
    return (found.group(1) if found else "", part.key)


def latest_ordinals(keyed: list[np.ndarray], stamps: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Given each part's (or file's) result keys in record order (parts oldest first), the
    ordinals in each part of the results that are the latest: a key's last record in the newest
    part holding it; with `stamps` (a number per record, like the keys), the latest stamp first."""
    if not keyed:
        return []
    key = np.concatenate([k.astype(np.uint64) for k in keyed])
    rank = np.concatenate([np.full(len(k), i, np.uint32) for i, k in enumerate(keyed)])
    ordinal = np.concatenate([np.arange(len(k), dtype=np.uint32) for k in keyed])
    by_stamp = (np.concatenate(stamps),) if stamps is not None else ()
    order = np.lexsort((ordinal, rank, *by_stamp, key))  # by key, then oldest to newest (stamp, part, record)
    key, rank, ordinal = key[order], rank[order], ordinal[order]
    last = np.ones(len(key), bool)
    last[:-1] = key[1:] != key[:-1]
    rank, ordinal = rank[last], ordinal[last]
    return [np.sort(ordinal[rank == i]) for i in range(len(keyed))]


def latest_in_parts(out: Storage, parts: list[ObjectRef], log,
                    report: dict) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """For each part (oldest first), its result keys in its final records' order and the
    ordinals among them of the results that are the latest (`latest_ordinals`). A part that
    cannot be read is named in `report` as skipped (it has no keys)."""
    rows_of, unreadable = read_part_rows(out, parts, log)
    for key in unreadable:
        report["skipped_parts"][out.describe(key)] = "unreadable"
    keyed = [rows_of[part.key]["key"] if part.key in rows_of else np.empty(0, np.uint64) for part in parts]
    return keyed, latest_ordinals(keyed)


def select_rows(out: Storage, chosen: Iterable[tuple[ObjectRef, np.ndarray]], log,
                report: dict) -> Iterator[list[dict[str, Any]]]:
    """The rows of the chosen records, a list per part: for each part, the ordinals (among its
    final records, as its done-index rows count them) to take."""

    @functools.cache
    def source_of(run: str) -> str | None:
        """The source (or manifest) run `run` read, from its manifest (a fanned-out run's one, for
        its partitions' records too); None where there is none (named in `runs_without_source`)."""
        try:
            parameters = json.loads(out.read(manifest_key(run))).get("parameters") or {}
            return parameters.get("source") or parameters.get("manifest")
        except Exception as exc:  # noqa: BLE001 - a run that wrote no manifest (killed): no source column
            reason = f"{type(exc).__name__}: {exc}"
            report.setdefault("runs_without_source", {})[run] = reason
            log.warning("run's manifest unreadable; its rows have no source", run_id=run,
                        manifest=out.describe(manifest_key(run)), error=reason)
            return None

    for part, wanted in chosen:
        name = out.describe(part.key)
        if not len(wanted) or name in report["skipped_parts"]:
            continue
        try:
            data = out.read(part.key)
            records, bad = final_records(data.decode("utf-8").splitlines())
        except (OSError, UnicodeDecodeError) as exc:
            report["skipped_parts"][name] = f"unreadable: {exc}"
            log.warning("results part unreadable; left out of the Parquet export", part=name, error=str(exc))
            continue
        if bad or not data.endswith(b"\n"):
            report["damaged_parts"][name] = f"{bad} line(s) are not records (cut short?)"
        # Rows keyed in pass one come from the same body (a part is written once, whole): each
        # wanted ordinal names a final record.
        yield [view_row(records[i], source_of(run_of(records[i].run_id))) for i in wanted if i < len(records)]


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
    """An export's result: `fields`, `complete` (no part damaged or skipped), the seconds since
    `started`, and the report's entries that are not empty."""
    complete = not report["damaged_parts"] and not report["skipped_parts"]
    return {**fields, "complete": complete, "seconds": round(time.perf_counter() - started, 3),
            **{k: v for k, v in report.items() if v}}


def export_parquet(out: Storage, target: Storage, target_key: str, *,
                   row_group_rows: int = ROW_GROUP_ROWS) -> dict:
    """Write the output `out`'s final records (every part, every fingerprint) as one Parquet
    file, `target_key` in `target`, and return a report: where, rows, row groups, seconds, and
    any damaged or skipped parts."""
    started = time.perf_counter()
    log = get_logger()
    report: dict[str, Any] = {"damaged_parts": {}, "skipped_parts": {}}
    by_fingerprint: dict[str, list[ObjectRef]] = {}  # each fingerprint's parts, oldest first
    for ref in sorted(out.iter_objects(prefix="results/"), key=part_order):
        segments = ref.key.split("/")
        if len(segments) == 3 and segments[2].endswith(".jsonl"):
            by_fingerprint.setdefault(segments[1], []).append(ref)
    chosen = ((part, wanted) for _, parts in sorted(by_fingerprint.items())  # each one's latest results
              for part, wanted in zip(parts, latest_in_parts(out, parts, log, report)[1]))
    rows, groups = write_rows(target, target_key, select_rows(out, chosen, log, report), row_group_rows=row_group_rows)
    result = finished(report, started, path=target.describe(target_key), rows=rows, row_groups=groups)
    if result["complete"]:
        log.info("results exported as Parquet", path=result["path"], rows=rows)
    else:
        log.warning("results exported as Parquet without some parts", path=result["path"], rows=rows,
                    damaged=list(report["damaged_parts"]), skipped=list(report["skipped_parts"]))
    return result
