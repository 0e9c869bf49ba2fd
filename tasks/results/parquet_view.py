"""The Parquet view of an output: every file under <output>/parquet/ (a run's, or compacted ones:
tasks/results/layout.py) read as ONE dataset holds each final result once, the latest (the rules
of tasks/results/parquet.py), and grows with what each run adds, not with the history.

Read it as one: `datasets.load_dataset("parquet", data_files="OUT/parquet/*.parquet")`,
`pyarrow.dataset.dataset("OUT/parquet/")`, `pandas.read_parquet("OUT/parquet/")`, DuckDB's
`read_parquet('OUT/parquet/*.parquet')`.

- A run that wrote no part reads and writes nothing here.
- A run that wrote parts lists and reads only its own parts and writes its file; it neither
  lists nor reads the history. Which earlier results it computed again (an object re-uploaded
  since, a retryable failure), and in which view file or part they stand, the done-index it
  loaded at its start tells (kept by `load_done_index` for this step; one is loaded here where
  the process has none, as when `add_run` is called on its own). Each such result is then
  removed from the older file that holds it, which is rewritten: the view file the done-index
  read it from, or, for a part, the file of the run that wrote it; where that file is gone since
  (compaction or a rebuild merged it), the compacted files. The new file is written before an
  older one is rewritten: a reader in between, or a crash, sees a result twice, never not at
  all; compaction settles that.
- The view is also what the done-index reads (its hash columns, tasks/results/done_rows.py): a
  view file deleted by hand makes its results be computed again; `vlm-caption export OUTPUT`
  rebuilds the view from the parts.
- A run owes the view its file from its first part on: before that part it leaves an empty
  `results/<fp>/view-owed/<run_id>` (tasks/results/writers.py `owe_view`), removed once its file is written. A run killed
  at any moment before then (or whose export failed) leaves it, and the next run of the job, with
  or without new items, adds that run's file from all of its parts before its own
  (`add_owed_runs`, one listing of a folder that is empty on a normal night): a rerun makes the
  view whole, and its manifest's `complete` says whether it did. `vlm-caption export OUTPUT`
  rebuilds the view from every part, as one file.
- Compaction (`vlm-caption export OUTPUT --compact`, tasks/results/parquet_compact.py says how)
  merges the view's files into one. Run it while no run of the output is ending: a run that
  rewrites a file compaction has just merged leaves a result twice, until the next compaction.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import NONE

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.results.done_index import DoneIndex, loaded_index, read_done_index
from vlm_caption.tasks.results.done_rows import listed_under, result_key, view_files
from vlm_caption.tasks.results.layout import (PARQUET_VIEW_PREFIX, part_prefix, part_run, run_parquet_key,
                                              view_owed_key, view_owed_prefix)
from vlm_caption.tasks.results.parquet import latest_in_parts, part_order, select_rows, write_rows
from vlm_caption.tasks.results.parquet_compact import kept_rows
from vlm_caption.tasks.sources.storage import Storage, key_within

def add_owed_runs(out: Storage, fingerprint: str, run_id: str, log, earlier: DoneIndex | None) -> dict[str, dict]:
    """The view's file of each earlier run of this job that wrote parts and never had its file
    written (killed, or its export failed), added oldest first: {run: what `add_run` wrote, or
    {"error": ...}}. `earlier`: the done-index of this run's start (loaded here if needed and None)."""
    # Oldest first, by the UTC stamp in the run's id, as parts are ordered.
    owed = [ref.key.rsplit("/", 1)[-1]
            for ref in sorted(out.iter_objects(prefix=view_owed_prefix(fingerprint)), key=part_order)]
    added: dict[str, dict] = {}
    for run in owed:
        if run == run_id:
            continue
        log.warning("Parquet view: adding the results of a run that ended before its view file", run=run)
        try:
            if earlier is None:
                earlier = read_done_index(out, fingerprint)
            added[run] = add_run(out, fingerprint, run, [], whole_run=True, earlier=earlier)
        except Exception as exc:  # noqa: BLE001 - recorded; the mark stays, so the next run tries again
            added[run] = {"error": f"{type(exc).__name__}: {exc}", "complete": False}
    return added


def add_run(out: Storage, fingerprint: str, run_id: str, parts: list[str], *, earlier: DoneIndex | None = None,
            whole_run: bool = False) -> dict:
    """Add the final results of run `run_id` (its parts `parts`, as the run names them, and any
    other part listed under its id; with `whole_run`, every part listed under it) to the view,
    and return what was written: the run's file and rows, the older files rewritten (rows
    removed from each), damaged parts. `earlier`: the done-index of the run's start (by default
    as the module's docstring says)."""
    started = time.perf_counter()
    if not parts and not whole_run:  # nothing new: nothing to read, nothing to write
        return {"path": None, "rows": 0, "complete": True, "seconds": 0.0}
    log = get_logger(run_id=run_id, fingerprint=fingerprint)
    report: dict[str, Any] = {"damaged_parts": {}, "skipped_parts": {}}
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
    again: set[tuple[str, str]] = set()  # (item key, question) of the results replaced: few, usually none

    def batches():
        for batch in select_rows(out, zip(mine, wanted), log, report):
            if replaced:
                again.update((row["key"], row["question"] or "") for row in batch
                             if result_key(row["key"], row["question"]) in replaced)
            yield batch

    rows, groups = write_rows(out, key, batches(), empty_too=False)
    rewritten: dict[str, int] = {}
    for member in holders if rows else []:
        try:
            removed = _drop_rows(out, member, fingerprint, again)
        except Exception as exc:  # noqa: BLE001 - the run's own file is written; compaction settles it
            report.setdefault("not_rewritten", {})[out.describe(member)] = f"{type(exc).__name__}: {exc}"
            log.warning("Parquet view: an older file holding results this run replaced could not be "
                        "rewritten; they appear twice until `vlm-caption export OUTPUT --compact`",
                        file=out.describe(member), error=f"{type(exc).__name__}: {exc}")
            continue
        if removed:
            rewritten[out.describe(member)] = removed
    out.delete(view_owed_key(fingerprint, run_id))  # the run's file is written: the view owes it nothing
    complete = not report["damaged_parts"] and not report["skipped_parts"]
    result = {"path": out.describe(key) if rows else None, "rows": rows, "row_groups": groups,
              "complete": complete, "seconds": round(time.perf_counter() - started, 3),
              **({"rewritten": rewritten} if rewritten else {}),
              **{k: v for k, v in report.items() if v}}
    (log.info if complete else log.warning)("Parquet view: the run's results added", path=result["path"], rows=rows,
                                            rewritten=len(rewritten))
    return result


def _holders(out: Storage, earlier: DoneIndex, mine: set[str], added: np.ndarray,
             own: str) -> tuple[list[str], set[int]]:
    """The view's files that may hold an earlier record of a result this run added (which: the
    module's docstring), and those results' keys, as the done-index says."""
    files = {ref.key for ref in view_files(out)} - {own}
    merged = sorted(key for key in files if not key.removeprefix(PARQUET_VIEW_PREFIX).startswith("run-"))
    holders: set[str] = set()
    replaced: set[int] = set()
    for source, keys in earlier.holding(added).items():
        if source in mine:
            continue
        replaced |= set(keys.tolist())
        file = source if source.startswith(PARQUET_VIEW_PREFIX) else run_parquet_key(part_run(source) or "")
        holders.update([file] if file in files else merged)
    return sorted(holders), replaced


def _drop_rows(out: Storage, key: str, fingerprint: str, results: set[tuple[str, str]]) -> int:
    """Rewrite view file `key` without its rows of `results` ((item key, question)) under
    `fingerprint`; the rows removed (nothing written when none). Finding them reads three
    columns; the rewrite goes row group by row group (`write_rows`: readers see the old file or the new one)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    source = pq.ParquetFile(pa.BufferReader(out.read(key)))
    ids = source.read(columns=["fingerprint", "key", "question"])
    items = pa.array(sorted({item for item, _ in results}), pa.string())
    maybe = pc.and_(pc.equal(ids["fingerprint"], fingerprint), pc.is_in(ids["key"], value_set=items))
    drop = [i for i in np.flatnonzero(maybe.fill_null(False).to_numpy(zero_copy_only=False))
            if (ids["key"][i].as_py(), ids["question"][i].as_py() or "") in results]
    if not drop:
        return 0
    write_rows(out, key, kept_rows(source, np.setdiff1d(np.arange(source.metadata.num_rows), drop)))
    return len(drop)


@task(name="export-parquet", cache_policy=NONE, persist_result=False)
def export_after_run(out: Storage, output_uri: str, fingerprint: str, run_id: str, parts: list[str]) -> dict:
    """The end-of-run step: the run's new results added to the view of its output `out`
    (`output_uri` as the job names it, for the message). A failure is logged and returned as
    `{"error": ...}`, never raised: the run's captions are in its JSON Lines parts. Runs the view
    still owes a file are added first (`add_owed_runs`); `complete` is true only when they and
    this run's own results are all in the view."""
    log = get_logger(run_id=run_id, fingerprint=fingerprint)
    try:
        earlier = loaded_index(out, fingerprint)  # this run's, from its start (None where it loaded none)
        repaired = add_owed_runs(out, fingerprint, run_id, log, earlier)
        result = add_run(out, fingerprint, run_id, parts, earlier=earlier)
    except Exception as exc:  # noqa: BLE001 - the parts are written; the next run adds them to the view
        log.warning("Parquet export failed; the JSON Lines parts are complete, and the next run of the job adds "
                    f"them to the view (or run `vlm-caption export {output_uri}`)", error=f"{type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}", "complete": False}
    if repaired:
        result = {**result, "repaired": repaired,
                  "complete": result["complete"] and all(r.get("complete") for r in repaired.values())}
    return result
