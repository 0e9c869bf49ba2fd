"""An output's final results as Parquet rows, for `datasets`, pandas, pyarrow or DuckDB: the
schema, the rules, and the one-file export (`vlm-caption export OUTPUT --to PATH`). The view a
run keeps under <output>/parquet/, one file per run, is tasks/results/parquet_view.py.

The JSON Lines parts stay the truth and the unit of atomic, resumable writes; Parquet is a view:

- it holds what the done-index counts (tasks/results/done_index.py): the final records (a
  caption, or an error a rerun would only repeat) of every readable part, under every
  fingerprint; a part that cannot be read is left out and named in the report;
- a result computed again by a later run (same fingerprint, item key and question, the
  done-index's key) appears once: the latest run's (the UTC stamp in the run id), then the
  later part name;
- each row carries its done-index row (`done_key`, `listed_hash`, `content_hash`: the done-index
  reads these columns, tasks/results/done_rows.py);
- a part cut short (lines that are not records) contributes the records it still holds, which
  the done-index counts as done too, and is named in the report under `damaged_parts` with
  `complete: false`;
- a file is written in row groups of ROW_GROUP_ROWS (memory: one part and one row group, plus
  16 bytes per result for the de-duplication), into a local temporary file, then put in place
  with one atomic write through the storage interface (a folder or s3://).
"""

from __future__ import annotations

import contextlib
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
from vlm_caption.tasks.sources.ranged import open_seekable
from vlm_caption.tasks.sources.storage import Storage

ROW_GROUP_ROWS = 8192
TIMING_KEYS = ("fetch_s", "decode_s", "generate_s")
STAMP_IN_NAME = re.compile(r"(?P<stamp>\d{8}T\d{6})")  # a run id's UTC stamp

# Record fields with a column of their own; every other field of ResultRecord (e.g. `structured`)
# becomes a string column: the value as it is when a string, else as JSON.
_OWN = {"key", "question", "text", "error", "model", "recipe", "run_id", "timings", "fingerprint", "size",
        "etag", "sha256", "prompt", "finish_reason", "prompt_tokens", "output_tokens", "members", "video"}


def results_schema():
    import pyarrow as pa

    extra = [name for name in ResultRecord.model_fields if name not in _OWN]
    return pa.schema([
        ("key", pa.string()), ("source", pa.string()), ("question", pa.string()), ("caption", pa.string()),
        ("error_kind", pa.string()), ("error_message", pa.string()),
        ("model", pa.string()), ("recipe", pa.string()), ("run_id", pa.string()), ("fingerprint", pa.string()),
        ("finish_reason", pa.string()), ("prompt_tokens", pa.int64()), ("output_tokens", pa.int64()),
        ("timings", pa.struct([(name, pa.float64()) for name in TIMING_KEYS])),
        ("prompt", pa.string()), ("size", pa.int64()), ("etag", pa.string()), ("sha256", pa.string()),
        ("members", pa.string()), ("video", pa.string()),  # JSON
        *[(name, pa.string()) for name in extra],
        *[(name, pa.uint64()) for name in VIEW_HASHES],
    ])


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False, default=str)


def view_row(record: ResultRecord, source: str | None, extra: list[str]) -> dict[str, Any]:
    error = record.error or {}
    row = {
        "key": record.key, "source": source, "question": record.question, "caption": record.text,
        "error_kind": error.get("kind"), "error_message": error.get("message"),
        "model": record.model, "recipe": record.recipe, "run_id": record.run_id,
        "fingerprint": record.fingerprint, "finish_reason": record.finish_reason,
        "prompt_tokens": record.prompt_tokens, "output_tokens": record.output_tokens,
        "timings": {name: record.timings.get(name) for name in TIMING_KEYS},
        "prompt": record.prompt, "size": record.size, "etag": record.etag, "sha256": record.sha256,
        "members": _json([m.model_dump() for m in record.members] if record.members else None),
        "video": _json(record.video),
    }
    for name in extra:
        value = getattr(record, name, None)
        row[name] = value if value is None or isinstance(value, str) else _json(value)
    row.update(zip(VIEW_HASHES, record_row(record)))
    return row


def record_from_row(row: dict[str, Any]) -> ResultRecord:
    """The record a view row was made from (`view_row`), as far as a copy of its answer needs it:
    every field but a string-valued `structured` that reads as JSON."""
    fields = {name: row.get(name) for name in ResultRecord.model_fields if name not in _OWN}
    for name, value in fields.items():
        if isinstance(value, str) and ResultRecord.model_fields[name].annotation != (str | None):
            with contextlib.suppress(ValueError):
                fields[name] = json.loads(value)
    error = {"kind": row["error_kind"], "message": row["error_message"]} if row.get("error_kind") else None
    return ResultRecord(
        key=row["key"], question=row["question"], text=row["caption"], error=error, model=row["model"],
        recipe=row["recipe"], run_id=row["run_id"], fingerprint=row["fingerprint"],
        finish_reason=row["finish_reason"], prompt_tokens=row["prompt_tokens"] or 0,
        output_tokens=row["output_tokens"] or 0, prompt=row["prompt"], size=row["size"], etag=row["etag"],
        sha256=row["sha256"], members=json.loads(row["members"]) if row.get("members") else None,
        video=json.loads(row["video"]) if row.get("video") else None,
        timings={k: v for k, v in (row.get("timings") or {}).items() if v is not None}, **fields)


def view_group_starts(out: Storage, key: str, size: int) -> np.ndarray:
    """The first row of each row group of view file `key` of `size` bytes (its footer: ranged reads on S3)."""
    import pyarrow.parquet as pq

    with open_seekable(out, key, size) as raw:
        meta = pq.ParquetFile(raw).metadata
        return np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])[:-1]


def view_group_records(out: Storage, key: str, size: int, group: int) -> list[ResultRecord]:
    """The records of row group `group` of view file `key` of `size` bytes (`record_from_row`)."""
    import pyarrow.parquet as pq

    with open_seekable(out, key, size) as raw:
        return [record_from_row(row) for row in pq.ParquetFile(raw).read_row_group(group).to_pylist()]


def part_order(part: ObjectRef) -> tuple[str, str]:
    """Parts sort by their run's UTC stamp (`part-<8 hex>-<stamp>[-pN]-<shard>.jsonl`), then name."""
    found = STAMP_IN_NAME.search(part.key.rsplit("/", 1)[-1])
    return (found.group(1) if found else "", part.key)


def _list_parts(out: Storage) -> dict[str, list[ObjectRef]]:
    """The parts of each fingerprint, oldest first."""
    by_fingerprint: dict[str, list[ObjectRef]] = {}
    for ref in out.iter_objects(prefix="results/"):
        segments = ref.key.split("/")
        if len(segments) == 3 and segments[2].endswith(".jsonl"):
            by_fingerprint.setdefault(segments[1], []).append(ref)
    return {fp: sorted(parts, key=part_order) for fp, parts in sorted(by_fingerprint.items())}


class _Sources:
    """The source (or manifest) each run read, from its manifest; None where there is none (the
    run is named in the report's `runs_without_source`, and logged)."""

    def __init__(self, out: Storage, log, report: dict):
        self.out, self.known, self.log, self.report = out, {}, log, report

    def __call__(self, run_id: str) -> str | None:
        # A fanned-out run's partitions name their records `<run_id>-p<N>`; the run's one
        # manifest is under its own id, read once for all of them.
        run = run_of(run_id)
        if run not in self.known:
            try:
                parameters = json.loads(self.out.read(manifest_key(run))).get("parameters") or {}
                self.known[run] = parameters.get("source") or parameters.get("manifest")
            except Exception as exc:  # noqa: BLE001 - a run that wrote no manifest (killed): no source column
                self.known[run] = None
                reason = f"{type(exc).__name__}: {exc}"
                self.report.setdefault("runs_without_source", {})[run] = reason
                self.log.warning("run's manifest unreadable; its rows have no source", run_id=run,
                                 manifest=self.out.describe(manifest_key(run)), error=reason)
        return self.known[run]


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


def select_rows(out: Storage, chosen: Iterable[tuple[ObjectRef, np.ndarray]], log, report: dict,
                rows_per_batch: int = ROW_GROUP_ROWS) -> Iterator[list[dict[str, Any]]]:
    """The rows of the chosen records, in batches of at most rows_per_batch: for each part, the
    ordinals (among its final records, as its done-index rows count them) to take."""
    extra = [name for name in ResultRecord.model_fields if name not in _OWN]
    sources = _Sources(out, log, report)
    batch: list[dict[str, Any]] = []
    for part, wanted in chosen:
        if not len(wanted) or out.describe(part.key) in report["skipped_parts"]:
            continue
        try:
            data = out.read(part.key)
            records, bad = final_records(data.decode("utf-8").splitlines())
        except (OSError, UnicodeDecodeError) as exc:
            report["skipped_parts"][out.describe(part.key)] = f"unreadable: {exc}"
            log.warning("results part unreadable; left out of the Parquet export",
                        part=out.describe(part.key), error=str(exc))
            continue
        if bad or not data.endswith(b"\n"):
            report["damaged_parts"][out.describe(part.key)] = f"{bad} line(s) are not records (cut short?)"
        # Rows keyed in pass one come from the same body (a part is written once, whole): each
        # wanted ordinal names a record.
        for ordinal in wanted:
            if ordinal < len(records):
                record = records[ordinal]
                batch.append(view_row(record, sources(record.run_id), extra))
            if len(batch) >= rows_per_batch:
                yield batch
                batch = []
    if batch:
        yield batch


def write_rows(target: Storage, key: str, batches: Iterable, *, row_group_rows: int = ROW_GROUP_ROWS,
               empty_too: bool = True) -> tuple[int, int]:
    """Write the batches (lists of rows, or tables of the export's schema) as one Parquet file,
    small ones gathered into row groups of `row_group_rows`, put in place as the module's
    docstring says (readers see the old file or the new one); the rows and row groups written.
    With empty_too=False, no rows write nothing."""
    import pyarrow.parquet as pq

    schema = results_schema()
    rows = groups = 0
    with tempfile.TemporaryDirectory(prefix="vlm-caption-parquet-") as tmp:
        path = Path(tmp) / "results.parquet"
        with pq.ParquetWriter(path, schema, compression="zstd") as writer:
            for table in _row_groups(batches, schema, row_group_rows):
                writer.write_table(table, row_group_size=row_group_rows)
                rows, groups = rows + len(table), groups + 1
        if rows or empty_too:
            target.write(key, path.read_bytes())
    return rows, groups


def _row_groups(batches: Iterable, schema, size: int) -> Iterator:
    """The batches as tables, small ones (a run's file, a part's records) gathered up to `size` rows."""
    import pyarrow as pa

    pending: list = []
    for batch in batches:
        pending.append(batch if isinstance(batch, pa.Table) else pa.Table.from_pylist(batch, schema=schema))
        if sum(len(t) for t in pending) >= size:
            yield pa.concat_tables(pending)
            pending = []
    if pending:
        yield pa.concat_tables(pending)


def export_parquet(out: Storage, target: Storage, target_key: str, *,
                   row_group_rows: int = ROW_GROUP_ROWS) -> dict:
    """Write the output `out`'s final records (every part, every fingerprint) as one Parquet
    file, `target_key` in `target`, and return a report: where, rows, row groups, seconds, and
    any damaged or skipped parts."""
    started = time.perf_counter()
    log = get_logger()
    report: dict[str, Any] = {"damaged_parts": {}, "skipped_parts": {}}
    by_fingerprint = _list_parts(out)  # each fingerprint's latest final results, part by part
    chosen = ((part, wanted) for parts in by_fingerprint.values()
              for part, wanted in zip(parts, latest_in_parts(out, parts, log, report)[1]))
    rows, groups = write_rows(target, target_key, select_rows(out, chosen, log, report, row_group_rows),
                              row_group_rows=row_group_rows)
    complete = not report["damaged_parts"] and not report["skipped_parts"]
    result = {"path": target.describe(target_key), "rows": rows, "row_groups": groups, "complete": complete,
              "seconds": round(time.perf_counter() - started, 3),
              **{k: v for k, v in report.items() if v}}
    if complete:
        log.info("results exported as Parquet", path=result["path"], rows=rows)
    else:
        log.warning("results exported as Parquet without some parts", path=result["path"], rows=rows,
                    damaged=list(report["damaged_parts"]), skipped=list(report["skipped_parts"]))
    return result
