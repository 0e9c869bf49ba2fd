"""The Parquet view of an output: the files under <output>/parquet/, read as one dataset, hold each
final result once, the latest, once every run has folded its parts into its file (`fold_run`);
until then a run's parts, in the view's folders, hold its results, so the view is never behind
what was written. docs/architecture.md, "Parquet is a view that grows with each run", has the
rules; docs/operations.md the compaction (`compact_view`) and the repair (`rebuild_view`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import NONE

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.results.done_index import DoneIndex, loaded_index, read_done_index
from vlm_caption.tasks.results.done_rows import view_file_rows, view_files, view_parts
from vlm_caption.tasks.results.layout import (PARQUET_VIEW_PREFIX, compacted_parquet_key, part_run,
                                              parts_prefix, run_parquet_key)
from vlm_caption.tasks.results.parquet import (chosen_tables, finished, kept_rows, latest_rows, merge_files,
                                               part_order, write_rows)
from vlm_caption.tasks.sources.items import ObjectRef
from vlm_caption.tasks.sources.storage import Storage, key_within


def fold_run(out: Storage, fingerprint: str, run_id: str, parts: list[ObjectRef], earlier: DoneIndex) -> dict:
    """Fold run `run_id`'s parts (its partitions' too) into its view file: their final results,
    each once, the latest, written as `parquet/run-<run_id>.parquet`; a result they replaced taken
    out of the older file that held it (as `earlier`, a done-index of the output, says); then the
    parts deleted. Each step leaves every result in the view, at worst twice (a kill between
    them): folded again by the next run, with its file where it was written."""
    started = time.perf_counter()
    log = get_logger(run_id=run_id, fingerprint=fingerprint)
    key = run_parquet_key(run_id)
    files = view_files(out.iter_objects(prefix=PARQUET_VIEW_PREFIX))
    # A run folded before and killed while deleting its parts: its file is read with the parts
    # left, so that the file written again holds every result of the run, not those parts' alone.
    sources = [ref for ref in files if ref.key == key] + sorted(parts, key=part_order)
    latest = latest_rows(out, sources)
    holders = _holders(files, earlier, {part.key for part in parts}, latest.done_keys, key)
    rows, groups = write_rows(out, key, chosen_tables(out, sources, latest.wanted), empty_too=False)
    rewritten: dict[str, int] = {}  # older view files: the rows removed from each
    report: dict[str, Any] = {"rewritten": rewritten, "skipped": latest.unreadable}
    for member, results in holders:
        try:
            removed = _drop_rows(out, member, fingerprint, results)
        except Exception as exc:  # noqa: BLE001 - the run's own file is written; compaction settles it
            report.setdefault("not_rewritten", {})[out.describe(member.key)] = f"{type(exc).__name__}: {exc}"
            log.warning("Parquet view: an older file holding results this run replaced could not be "
                        "rewritten; they appear twice until `vlm-caption export OUTPUT --compact`",
                        file=out.describe(member.key), error=f"{type(exc).__name__}: {exc}")
            continue
        if removed:
            rewritten[out.describe(member.key)] = removed
    for part in parts:
        if out.describe(part.key) not in latest.unreadable:  # an unreadable one stays, named, for a look
            out.delete(part.key)
    result = finished(report, started, path=out.describe(key) if rows else None, rows=rows, row_groups=groups)
    (log.info if result["complete"] else log.warning)("Parquet view: the run's results folded in", path=result["path"],
                                                      rows=rows, rewritten=len(rewritten))
    return result


def _holders(view: list[ObjectRef], earlier: DoneIndex, mine: set[str], added: np.ndarray,
             own: str) -> list[tuple[ObjectRef, set[int]]]:
    """The view's files (of `view`) that may hold an earlier record of a result the run added,
    each with those results' keys, as the done-index says: the file it read the record from, or
    for a part its run's file; where that file is gone since (merged), the compacted files."""
    files = {ref.key: ref for ref in view if ref.key != own}
    merged = [key for key in files if not key.removeprefix(PARQUET_VIEW_PREFIX).startswith("run-")]
    holders: dict[str, set[int]] = defaultdict(set)
    for source, keys in earlier.holding(added).items():
        if source in mine:
            continue
        in_folder = "/" in source.removeprefix(PARQUET_VIEW_PREFIX)  # a part, since folded into its run's file
        file = run_parquet_key(part_run(source) or "") if in_folder else source
        for holder in [file] if file in files else merged:
            holders[holder] |= set(keys.tolist())
    return [(files[key], holders[key]) for key in sorted(holders)]


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


def parts_by_run(out: Storage, fingerprint: str) -> dict[str, list[ObjectRef]]:
    """The parts under the view's folder of `fingerprint` (normally none), by the run that wrote
    them, the runs oldest first (by their ids' UTC stamps)."""
    runs: dict[str, list[ObjectRef]] = defaultdict(list)
    for ref in sorted(out.iter_objects(prefix=parts_prefix(fingerprint)), key=part_order):
        if (run := part_run(ref.key)) is not None:
            runs[run].append(ref)
    return dict(runs)


@task(name="export-parquet", cache_policy=NONE, persist_result=False)
def export_after_run(out: Storage, output_uri: str, fingerprint: str, run_id: str) -> dict:
    """The end-of-run step: the parts an earlier run of this job left (killed before its end),
    oldest run first, then this run's, folded into the view of `out` (`output_uri` as the job
    names it, for the message). A failure is logged and returned as `{"error": ...}`, never
    raised: the parts stay in the view and the next run folds them. `complete`: all folded."""
    log = get_logger(run_id=run_id, fingerprint=fingerprint)
    repaired: dict[str, dict] = {}  # each earlier run: what `fold_run` wrote, or {"error": ...}
    try:
        runs = parts_by_run(out, fingerprint)
        mine = runs.pop(run_id, [])
        earlier = loaded_index(out, fingerprint)  # this run's, from its start (None where it loaded none)
        if (runs or mine) and earlier is None:  # (not `or`: an empty index, a first run's, is falsy)
            earlier = read_done_index(out, fingerprint)
        for run in runs:
            log.warning("Parquet view: folding in the parts of a run that ended before its view file", run=run)
            try:
                repaired[run] = fold_run(out, fingerprint, run, runs[run], earlier)
            except Exception as exc:  # noqa: BLE001 - recorded; its parts stay, so the next run tries again
                repaired[run] = {"error": f"{type(exc).__name__}: {exc}", "complete": False}
        result = fold_run(out, fingerprint, run_id, mine, earlier) if mine else \
            {"path": None, "rows": 0, "complete": True, "seconds": 0.0}
    except Exception as exc:  # noqa: BLE001 - the parts are in the view; the next run folds them
        log.warning("Parquet view: folding the run's parts failed; they stay in the view (parquet/<fingerprint>/), "
                    f"and the next run of the job folds them (or run `vlm-caption export {output_uri}`)",
                    error=f"{type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}", "complete": False}
    if repaired:
        result = {**result, "repaired": repaired,
                  "complete": result["complete"] and all(r.get("complete") for r in repaired.values())}
    return result


def compact_view(out: Storage) -> dict:
    """Merge the view's files into one (`parquet/compacted-<stamp>-<tag>.parquet`), a result held
    twice kept once (the latest), then remove the files merged. The parts are left to the runs."""
    started = time.perf_counter()
    files = view_files(out.iter_objects(prefix=PARQUET_VIEW_PREFIX))
    if len(files) < 2:
        return {"path": out.describe(files[0].key) if files else None, "merged": [], "rows": None,
                "seconds": round(time.perf_counter() - started, 3)}
    result = merge_files(out, files, out, compacted_parquet_key())  # runs' small files gathered into row groups
    if not result["complete"]:  # a file left out would lose its rows: the merged file goes, the files stay
        out.delete(key_within(out, result["path"]))
        return {**result, "path": None, "merged": []}
    for ref in files:  # after the merged file is in place: a reader sees a result twice, never not at all
        out.delete(ref.key)
    get_logger().info("Parquet view compacted", path=result["path"], rows=result["rows"], merged=len(files))
    return {**result, "merged": [out.describe(ref.key) for ref in files]}


def rebuild_view(out: Storage) -> dict:
    """Make the view whole (`vlm-caption export OUTPUT`): every part a run left, of every
    fingerprint, folded in (oldest run first), then the view's files compacted into one."""
    started = time.perf_counter()
    fingerprints = sorted({ref.key.split("/")[1] for ref in view_parts(out.iter_objects(prefix=PARQUET_VIEW_PREFIX))})
    folded: dict[str, dict] = {}
    for fingerprint in fingerprints:
        runs = parts_by_run(out, fingerprint)
        earlier = read_done_index(out, fingerprint) if runs else None
        for run in runs:
            folded[run] = fold_run(out, fingerprint, run, runs[run], earlier)
    compacted = compact_view(out)
    skipped = {k: v for r in [*folded.values(), compacted] for k, v in r.get("skipped", {}).items()}
    return finished({"skipped": skipped}, started, path=compacted["path"], rows=compacted["rows"], folded=folded,
                    merged=compacted["merged"])
