"""The Parquet view of an output: the files under <output>/parquet/, read as one dataset, hold each
final result once, the latest. docs/architecture.md, "Parquet is a view that grows with each run",
has the rules; docs/operations.md the compaction (`compact_view`) and the rebuild (`rebuild_view`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import NONE

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.results.done_index import DoneIndex, loaded_index, read_done_index
from vlm_caption.tasks.results.done_rows import ROW, listed_under, result_key, table_rows, view_file_rows, view_files
from vlm_caption.tasks.results.layout import (PARQUET_VIEW_PREFIX, VIEW_HASHES, compacted_parquet_key, part_prefix,
                                              part_run, run_parquet_key, view_owed_key, view_owed_prefix)
from vlm_caption.tasks.results.parquet import (STAMP_IN_NAME, export_parquet, finished, latest_in_parts,
                                               latest_ordinals, part_order, results_schema, select_rows, write_rows)
from vlm_caption.tasks.sources.items import ObjectRef
from vlm_caption.tasks.sources.storage import Storage, key_within

def add_run(out: Storage, fingerprint: str, run_id: str, parts: list[str], *, earlier: DoneIndex | None = None,
            whole_run: bool = False) -> dict:
    """Add the final results of run `run_id` (its parts `parts`, and any other part listed under
    its id; with `whole_run`, every part listed under it) to the view, and return what was
    written: the run's file and rows, the older files rewritten (rows removed from each), damaged
    parts. `earlier`: the done-index of the run's start (by default `loaded_index`'s)."""
    started = time.perf_counter()
    if not parts and not whole_run:  # nothing new: nothing to read, nothing to write
        return {"path": None, "rows": 0, "complete": True, "seconds": 0.0}
    log = get_logger(run_id=run_id, fingerprint=fingerprint)
    rewritten: dict[str, int] = {}  # older view files: the rows removed from each
    report: dict[str, Any] = {"rewritten": rewritten, "damaged_parts": {}, "skipped_parts": {}}
    named = {key_within(out, part) for part in parts}
    # The run's own parts and its partitions' (a prefix of their own), and any named elsewhere.
    listed = listed_under(out, [part_prefix(fingerprint, run_id)])
    listed.update(listed_under(out, [key.removesuffix(".jsonl") for key in named - listed.keys()]))
    mine = sorted((ref for key, ref in listed.items()
                   if key.endswith(".jsonl") and (key in named or part_run(key) == run_id)), key=part_order)
    for key in sorted(named - {part.key for part in mine}):
        report["skipped_parts"][out.describe(key)] = "not found"
    keyed, wanted = latest_in_parts(out, mine, log, report)
    added = np.unique(np.concatenate([k[w] for k, w in zip(keyed, wanted)] or [np.empty(0, np.uint64)]))
    key = run_parquet_key(run_id)
    if earlier is None:
        earlier = loaded_index(out, fingerprint)
        if earlier is None:  # (not `or`: an empty index, a first run's, is falsy)
            earlier = read_done_index(out, fingerprint)
    holders, replaced = _holders(out, earlier, {part.key for part in mine}, added, key)
    again: set[int] = set()  # the results replaced that are in the run's file: few, usually none

    def batches():
        for batch in select_rows(out, zip(mine, wanted), log, report):
            again.update(row["done_key"] for row in batch if row["done_key"] in replaced)
            yield batch

    rows, groups = write_rows(out, key, batches(), empty_too=False)
    for member in holders if rows else []:
        try:
            removed = _drop_rows(out, member, fingerprint, again)
        except Exception as exc:  # noqa: BLE001 - the run's own file is written; compaction settles it
            report.setdefault("not_rewritten", {})[out.describe(member.key)] = f"{type(exc).__name__}: {exc}"
            log.warning("Parquet view: an older file holding results this run replaced could not be "
                        "rewritten; they appear twice until `vlm-caption export OUTPUT --compact`",
                        file=out.describe(member.key), error=f"{type(exc).__name__}: {exc}")
            continue
        if removed:
            rewritten[out.describe(member.key)] = removed
    out.delete(view_owed_key(fingerprint, run_id))  # the run's file is written: the view owes it nothing
    result = finished(report, started, path=out.describe(key) if rows else None, rows=rows, row_groups=groups)
    (log.info if result["complete"] else log.warning)("Parquet view: the run's results added", path=result["path"],
                                                      rows=rows, rewritten=len(rewritten))
    return result


def _holders(out: Storage, earlier: DoneIndex, mine: set[str], added: np.ndarray,
             own: str) -> tuple[list[ObjectRef], set[int]]:
    """The view's files that may hold an earlier record of a result this run added, and those
    results' keys, as the done-index says: the file it read the record from, or for a part its
    run's file; where that file is gone since (merged), the compacted files."""
    files = {ref.key: ref for ref in view_files(out) if ref.key != own}
    merged = [key for key in files if not key.removeprefix(PARQUET_VIEW_PREFIX).startswith("run-")]
    holders: set[str] = set()
    replaced: set[int] = set()
    for source, keys in earlier.holding(added).items():
        if source in mine:
            continue
        replaced |= set(keys.tolist())
        file = source if source.startswith(PARQUET_VIEW_PREFIX) else run_parquet_key(part_run(source) or "")
        holders.update([file] if file in files else merged)
    return [files[key] for key in sorted(holders)], replaced


def _drop_rows(out: Storage, ref: ObjectRef, fingerprint: str, results: set[int]) -> int:
    """Rewrite view file `ref` without its rows of `results` (their done-index keys) under
    `fingerprint`, row group by row group; the rows removed (nothing written when none)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, at, _ = view_file_rows(out, ref, fingerprint)
    drop = np.flatnonzero(np.isin(rows["key"], np.array(sorted(results), np.uint64)))
    if not len(drop):
        return 0
    source = pq.ParquetFile(pa.BufferReader(out.read(ref.key)))
    write_rows(out, ref.key, kept_rows(source, np.setdiff1d(np.arange(source.metadata.num_rows),
                                                            drop if at is None else at[drop])))
    return len(drop)


@task(name="export-parquet", cache_policy=NONE, persist_result=False)
def export_after_run(out: Storage, output_uri: str, fingerprint: str, run_id: str, parts: list[str]) -> dict:
    """The end-of-run step: the file of each earlier run of this job that wrote parts and never
    had its file written (killed, or its export failed), oldest first, then this run's new
    results, added to the view of `out` (`output_uri` as the job names it, for the message). A
    failure is logged and returned as `{"error": ...}`, never raised: the run's captions are in
    its parts. `complete`: they and this run's results are all in the view."""
    log = get_logger(run_id=run_id, fingerprint=fingerprint)
    repaired: dict[str, dict] = {}  # each owed run: what `add_run` wrote, or {"error": ...}
    try:
        earlier = loaded_index(out, fingerprint)  # this run's, from its start (None where it loaded none)
        for ref in sorted(out.iter_objects(prefix=view_owed_prefix(fingerprint)), key=part_order):
            run = ref.key.rsplit("/", 1)[-1]
            if run == run_id:
                continue
            log.warning("Parquet view: adding the results of a run that ended before its view file", run=run)
            try:
                if earlier is None:
                    earlier = read_done_index(out, fingerprint)
                repaired[run] = add_run(out, fingerprint, run, [], whole_run=True, earlier=earlier)
            except Exception as exc:  # noqa: BLE001 - recorded; the mark stays, so the next run tries again
                repaired[run] = {"error": f"{type(exc).__name__}: {exc}", "complete": False}
        result = add_run(out, fingerprint, run_id, parts, earlier=earlier)
    except Exception as exc:  # noqa: BLE001 - the parts are written; the next run adds them to the view
        log.warning("Parquet export failed; the JSON Lines parts are complete, and the next run of the job adds "
                    f"them to the view (or run `vlm-caption export {output_uri}`)", error=f"{type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}", "complete": False}
    if repaired:
        result = {**result, "repaired": repaired,
                  "complete": result["complete"] and all(r.get("complete") for r in repaired.values())}
    return result


def kept_rows(source, keep: np.ndarray) -> Iterator:
    """The rows of ParquetFile `source` whose indexes are in sorted `keep`, as tables in the view's
    schema, row group by row group (memory: one row group)."""
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


def compact_view(out: Storage) -> dict:
    """Merge the view's files into one (`parquet/compacted-<stamp>-<tag>.parquet`), a result
    held twice kept once (the latest), then remove the files merged. Reads the view, no part."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    started = time.perf_counter()
    files = view_files(out)
    if len(files) < 2:
        return {"path": out.describe(files[0].key) if files else None, "merged": [], "rows": None,
                "seconds": round(time.perf_counter() - started, 3)}
    # Each row's result (fingerprint, item key, question) and its run's stamp: the latest run's row
    # is kept, then the later file's, then the later row. Memory: 24 bytes a row.
    hashes, stamps = [], []
    for ref in files:
        table = pq.read_table(pa.BufferReader(out.read(ref.key)), columns=["fingerprint", "key", "question", "run_id"])
        hashes.append(np.fromiter((result_key(f"{fp}\x1f{key}", question) for fp, key, question in zip(
            table["fingerprint"].to_pylist(), table["key"].to_pylist(), table["question"].to_pylist())),
            np.uint64, len(table)))
        stamp = pc.struct_field(pc.extract_regex(pc.fill_null(table["run_id"], ""), STAMP_IN_NAME.pattern), [0])
        stamps.append(pc.fill_null(pc.cast(pc.replace_substring(stamp, "T", ""), pa.int64()), 0).to_numpy())
    keep, total = latest_ordinals(hashes, stamps), sum(len(h) for h in hashes)
    key = compacted_parquet_key()
    tables = (table for ref, wanted in zip(files, keep) if len(wanted)
              for table in kept_rows(pq.ParquetFile(pa.BufferReader(out.read(ref.key))), wanted))
    rows, _ = write_rows(out, key, tables)  # runs' small files gathered into row groups
    for ref in files:  # after the merged file is in place: a reader sees a result twice, never not at all
        out.delete(ref.key)
    result = {"path": out.describe(key), "rows": rows, "merged": [out.describe(ref.key) for ref in files],
              "duplicates_dropped": total - rows, "seconds": round(time.perf_counter() - started, 3)}
    get_logger().info("Parquet view compacted", path=result["path"], rows=rows, merged=len(files))
    return result


def rebuild_view(out: Storage) -> dict:
    """The view made again from every part (`vlm-caption export OUTPUT`): one compacted file,
    then the files it replaces and the owed marks (their runs are in it) removed."""
    files = view_files(out)
    owed = [ref.key for ref in out.iter_objects(prefix="results/") if "/view-owed/" in ref.key]
    report = export_parquet(out, out, compacted_parquet_key())
    for key in [ref.key for ref in files] + owed:
        out.delete(key)
    return {**report, "replaced": [out.describe(ref.key) for ref in files]}
