"""The Parquet view of an output: every file under <output>/parquet/ read as ONE dataset holds
each final result once, the latest (the rules of tasks/results/parquet.py), and grows with
what each run adds, not with the history.

    parquet/run-<run_id>.parquet              the final results a run added, written at its end
    parquet/compacted-<stamp>-<tag>.parquet   many runs' rows in one file (compaction, rebuild)
    parquet/results.parquet                   the one file older versions rebuilt at each run's
                                              end; it stays a member of the view like the others

Read it as one: `datasets.load_dataset("parquet", data_files="OUT/parquet/*.parquet")`,
`pyarrow.dataset.dataset("OUT/parquet/")`, `pandas.read_parquet("OUT/parquet/")`, DuckDB's
`read_parquet('OUT/parquet/*.parquet')`.

- A run that wrote no part reads and writes nothing here.
- A run that wrote parts reads its fingerprint's done-index rows part by part (what its own
  load read: the compacted index and the sidecars written since), parses only its own parts and
  writes its file. A result it computed again (an object re-uploaded since) is then removed from
  the older file that holds it, which is rewritten: the file of the run whose part held the
  earlier record, or, where that run has no file of its own (it ended before this view, or
  compaction merged it), the compacted files and the old one. The run that wrote a part cut
  short since has its file checked against every result this run added (the cut records are
  the ones computed again). The new file is written before an older one is rewritten: a reader
  in between, or a crash, sees a result twice, never not at all; compaction settles that.
- A run killed before its end wrote no file, nor did one whose export failed (its manifest
  says so): `vlm-caption export OUTPUT` rebuilds the view from every part, as one file.
- Compaction (`vlm-caption export OUTPUT --compact`) merges the view's files into one, keeping
  the latest of a result held twice (by the run's stamp), from the files alone (no part is
  read); it writes the merged file, then removes the ones it merged. Run it while no run of
  the output is ending: a run that rewrites a file compaction has just merged leaves a result
  twice, until the next compaction.
"""

from __future__ import annotations

import io
import time
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import NONE

from tasks.observability import get_logger
from tasks.results.done_index import load_part_rows
from tasks.results.layout import (LEGACY_PARQUET_KEY, PARQUET_VIEW_PREFIX, compacted_parquet_key, part_run,
                                  run_parquet_key)
from tasks.results.parquet import (RESIZED, ROW_GROUP_ROWS, _part_order, _schema, export_parquet, latest_ordinals,
                                   select_rows, write_rows)
from tasks.sources.items import ObjectRef
from tasks.sources.storage import Storage, key_within

_NO_ROWS = np.empty(0, dtype=[("key", "<u8")])
_STAMP_PATTERN = r"(?P<stamp>\d{8}T\d{6})"


def _member_order(ref: ObjectRef) -> tuple[int, str]:
    """The old single file, then compacted files, then run files, each by name (its stamp)."""
    name = ref.key.removeprefix(PARQUET_VIEW_PREFIX)
    return (0 if ref.key == LEGACY_PARQUET_KEY else 1 if name.startswith("compacted-") else 2, name)


def view_files(out: Storage) -> list[ObjectRef]:
    """The view's files (the .parquet files directly under parquet/), oldest kind first."""
    return sorted((ref for ref in out.iter_objects(prefix=PARQUET_VIEW_PREFIX)
                   if ref.key.endswith(".parquet") and "/" not in ref.key.removeprefix(PARQUET_VIEW_PREFIX)),
                  key=_member_order)


def add_run(out: Storage, fingerprint: str, run_id: str, parts: list[str], *,
            row_group_rows: int = ROW_GROUP_ROWS) -> dict:
    """Add the final results of run `run_id` (its parts `parts`, as the run names them, and any
    other part the listing shows with its id) to the view, and return what was written: the
    run's file and rows, the older files rewritten (rows removed from each), damaged parts."""
    started = time.perf_counter()
    if not parts:  # nothing new: nothing to read, nothing to write
        return {"path": None, "rows": 0, "complete": True, "seconds": 0.0}
    log = get_logger(run_id=run_id, fingerprint=fingerprint)
    report: dict[str, Any] = {"damaged_parts": {}, "skipped_parts": {}}
    history = load_part_rows(out, fingerprint)
    named = {key_within(out, part) for part in parts}
    mine = sorted((ref for key, ref in history.parts.items() if key in named or part_run(key) == run_id),
                  key=_part_order)
    for key in sorted(named - history.parts.keys()):
        report["skipped_parts"][out.describe(key)] = "not found"
    for part in mine:
        if part.key in history.resized:
            report["damaged_parts"][out.describe(part.key)] = RESIZED
        if part.key not in history.rows:
            report["skipped_parts"][out.describe(part.key)] = "unreadable"
    keyed = [history.rows.get(part.key, _NO_ROWS)["key"] for part in mine]
    wanted = latest_ordinals(keyed)
    written: set[tuple[str, str]] = set()

    def batches():
        for batch in select_rows(out, zip(mine, wanted), log, report, row_group_rows):
            written.update((row["key"], row["question"] or "") for row in batch)
            yield batch

    key = run_parquet_key(run_id)
    rows, groups = write_rows(out, key, batches(), row_group_rows=row_group_rows, empty_too=False)
    rewritten: dict[str, int] = {}
    if rows:
        added = np.unique(np.concatenate([k[w] for k, w in zip(keyed, wanted)]).astype(np.uint64))
        for member in _holders(out, history, {part.key for part in mine}, added, key):
            try:
                removed = _drop_rows(out, member, fingerprint, written, row_group_rows)
            except Exception as exc:  # noqa: BLE001 - the run's own file is written; compaction settles it
                report.setdefault("not_rewritten", {})[out.describe(member)] = f"{type(exc).__name__}: {exc}"
                log.warning("Parquet view: an older file holding results this run replaced could not be "
                            "rewritten; they appear twice until `vlm-caption export OUTPUT --compact`",
                            file=out.describe(member), error=f"{type(exc).__name__}: {exc}")
                continue
            if removed:
                rewritten[out.describe(member)] = removed
    complete = not report["damaged_parts"] and not report["skipped_parts"]
    result = {"path": out.describe(key) if rows else None, "rows": rows, "row_groups": groups,
              "complete": complete, "seconds": round(time.perf_counter() - started, 3),
              **({"rewritten": rewritten} if rewritten else {}), **{k: v for k, v in report.items() if v}}
    (log.info if complete else log.warning)("Parquet view: the run's results added", path=result["path"], rows=rows,
                                            rewritten=len(rewritten))
    return result


def _holders(out: Storage, history, mine: set[str], added: np.ndarray, own: str) -> list[str]:
    """The view's files that may hold an earlier record of a result this run added: the file of
    each run whose part holds one (or whose part was cut short since), or, for a run without a
    file of its own, the compacted files and the old single file."""
    older = [key for key in history.rows if key not in mine]
    runs: set[str | None] = {part_run(key) for key in history.resized if key not in mine}
    if older:
        keys = np.concatenate([history.rows[key]["key"] for key in older]).astype(np.uint64)
        owner = np.repeat(np.arange(len(older)), [len(history.rows[key]) for key in older])
        at = np.minimum(np.searchsorted(added, keys), len(added) - 1)
        runs |= {part_run(older[i]) for i in np.unique(owner[added[at] == keys])}
    if not runs:
        return []
    files = {ref.key for ref in view_files(out)} - {own}
    merged = sorted(key for key in files if not key.removeprefix(PARQUET_VIEW_PREFIX).startswith("run-"))
    holders: set[str] = set()
    for run in runs:
        if run is not None and run_parquet_key(run) in files:
            holders.add(run_parquet_key(run))
        else:
            holders.update(merged)
    return sorted(holders)


def _drop_rows(out: Storage, key: str, fingerprint: str, results: set[tuple[str, str]], row_group_rows: int) -> int:
    """Rewrite view file `key` without its rows of `results` ((item key, question)) under
    `fingerprint`, row group by row group; the rows removed (nothing written when none)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    source = pq.ParquetFile(pa.BufferReader(out.read(key)))
    items = pa.array(sorted({item for item, _ in results}), pa.string())
    kept, removed = [], 0
    for index in range(source.num_row_groups):
        table = source.read_row_group(index)
        maybe = pc.and_(pc.equal(table["fingerprint"], fingerprint), pc.is_in(table["key"], value_set=items))
        drop = np.zeros(len(table), bool)
        for i in np.flatnonzero(maybe.fill_null(False).to_numpy(zero_copy_only=False)):
            drop[i] = (table["key"][i].as_py(), table["question"][i].as_py() or "") in results
        removed += int(drop.sum())
        kept.append(table.filter(pa.array(~drop)) if drop.any() else table)
    if removed:
        buffer = io.BytesIO()
        with pq.ParquetWriter(buffer, source.schema_arrow, compression="zstd") as writer:
            for table in kept:
                writer.write_table(table, row_group_size=row_group_rows)
        out.write(key, buffer.getvalue())  # one atomic write: readers see the old file or the new one
    return removed


def _conform(table, schema):
    """`table` with the columns of today's schema (a column an older version did not write is null)."""
    import pyarrow as pa

    return pa.Table.from_arrays([table[field.name].cast(field.type) if field.name in table.column_names
                                 else pa.nulls(len(table), field.type) for field in schema], schema=schema)


def _latest_rows(out: Storage, files: list[ObjectRef]) -> tuple[list[np.ndarray], int]:
    """For each file, the indexes of its rows that are the latest of their result (fingerprint,
    item key, question): the latest run's stamp, then the later file, then the later row; and
    the rows of all the files."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    tables = []
    for index, ref in enumerate(files):
        table = pq.read_table(pa.BufferReader(out.read(ref.key)), columns=["fingerprint", "key", "question", "run_id"])
        stamp = pc.struct_field(pc.extract_regex(pc.fill_null(table["run_id"], ""), _STAMP_PATTERN), [0])
        tables.append(pa.table({"f": pc.fill_null(table["fingerprint"], ""), "k": pc.fill_null(table["key"], ""),
                                "q": pc.fill_null(table["question"], ""), "s": pc.fill_null(stamp, ""),
                                "m": pa.array(np.full(len(table), index, np.int32)),
                                "r": pa.array(np.arange(len(table), dtype=np.int64))}))
    rows = pa.concat_tables(tables).combine_chunks()
    rows = rows.take(pc.sort_indices(rows, sort_keys=[(name, "ascending") for name in "fkqsmr"]))
    last = np.ones(len(rows), bool)
    if len(rows) > 1:
        same = pc.and_(pc.and_(pc.equal(rows["f"][:-1], rows["f"][1:]), pc.equal(rows["k"][:-1], rows["k"][1:])),
                       pc.equal(rows["q"][:-1], rows["q"][1:]))
        last[:-1] = ~same.to_numpy(zero_copy_only=False)
    member, row = rows["m"].to_numpy()[last], rows["r"].to_numpy()[last]
    return [np.sort(row[member == index]) for index in range(len(files))], len(rows)


def compact_view(out: Storage, *, row_group_rows: int = ROW_GROUP_ROWS) -> dict:
    """Merge the view's files into one (`parquet/compacted-<stamp>-<tag>.parquet`), a result
    held twice kept once (the latest), then remove the files merged. Reads the view, no part."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    started = time.perf_counter()
    files = view_files(out)
    if len(files) < 2:
        return {"path": out.describe(files[0].key) if files else None, "merged": [], "rows": None,
                "seconds": round(time.perf_counter() - started, 3)}
    keep, total = _latest_rows(out, files)
    schema, key = _schema(), compacted_parquet_key()
    rows = groups = 0
    buffer = io.BytesIO()
    with pq.ParquetWriter(buffer, schema, compression="zstd") as writer:
        for ref, wanted in zip(files, keep):
            if not len(wanted):
                continue
            table = _conform(pq.read_table(pa.BufferReader(out.read(ref.key))).take(pa.array(wanted)), schema)
            writer.write_table(table, row_group_size=row_group_rows)
            rows, groups = rows + len(table), groups + -(-len(table) // row_group_rows)
    out.write(key, buffer.getvalue())
    for ref in files:  # after the merged file is in place: a reader sees a result twice, never not at all
        out.delete(ref.key)
    result = {"path": out.describe(key), "rows": rows, "row_groups": groups,
              "merged": [out.describe(ref.key) for ref in files],
              "duplicates_dropped": total - rows,
              "seconds": round(time.perf_counter() - started, 3)}
    get_logger().info("Parquet view compacted", path=result["path"], rows=rows, merged=len(files))
    return result


def rebuild_view(out: Storage, *, row_group_rows: int = ROW_GROUP_ROWS) -> dict:
    """The view made again from every part (`vlm-caption export OUTPUT`): one compacted file,
    then the files it replaces removed. Reads the whole history: for repairs (a run killed
    before its end, parts changed by hand), not for each run."""
    files = view_files(out)
    report = export_parquet(out, out, compacted_parquet_key(), row_group_rows=row_group_rows)
    for ref in files:
        out.delete(ref.key)
    return {**report, "replaced": [out.describe(ref.key) for ref in files]}


@task(name="export-parquet", cache_policy=NONE, persist_result=False)
def export_after_run(out: Storage, output_uri: str, fingerprint: str, run_id: str, parts: list[str]) -> dict:
    """The end-of-run step: the run's new results added to the view of its output `out`
    (`output_uri` as the job names it, for the message). A failure is logged and returned as
    `{"error": ...}`, never raised: the run's captions are in its JSON Lines parts, and
    `vlm-caption export` makes the view again from them."""
    try:
        return add_run(out, fingerprint, run_id, parts)
    except Exception as exc:  # noqa: BLE001 - the parts are written; the view is a convenience
        get_logger().warning("Parquet export failed; the JSON Lines parts are complete. Run "
                             f"`vlm-caption export {output_uri}` to make the view again",
                             error=f"{type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
