"""Compaction and rebuild of the Parquet view (tasks/results/parquet_view.py says what the view
is): its files, listed; rows copied between files; the files merged into one
(`vlm-caption export OUTPUT --compact`), or the view made again from every part (`vlm-caption
export OUTPUT`)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.results.done_rows import ROW, result_key, table_rows, view_files
from vlm_caption.tasks.results.layout import VIEW_HASHES, compacted_parquet_key
from vlm_caption.tasks.results.parquet import STAMP_IN_NAME, export_parquet, latest_ordinals, results_schema, write_rows
from vlm_caption.tasks.sources.items import ObjectRef
from vlm_caption.tasks.sources.storage import Storage


def kept_rows(source, keep: np.ndarray) -> Iterator:
    """The rows of ParquetFile `source` whose indexes are in sorted `keep`, as tables, row group
    by row group (memory: one row group)."""
    import pyarrow as pa

    start = 0
    for index in range(source.num_row_groups):
        count = source.metadata.row_group(index).num_rows
        wanted = keep[np.searchsorted(keep, start):np.searchsorted(keep, start + count)] - start
        start += count
        if len(wanted):
            table = _conformed(source.read_row_group(index))
            yield table if len(wanted) == count else table.take(pa.array(wanted))


def _conformed(table):
    """`table` in the view's schema: a file written before a column existed (the done-index's
    hash columns among them) gets it, made from its other columns or empty."""
    import pyarrow as pa

    schema = results_schema()
    if table.schema.equals(schema):
        return table
    made = dict(zip(VIEW_HASHES, (pa.array(column) for column in (table_rows(table)[name] for name in ROW.names))))
    return pa.table([table[field.name] if field.name in table.column_names else
                     made.get(field.name, pa.nulls(len(table), field.type)) for field in schema], schema=schema)


def _latest_rows(out: Storage, files: list[ObjectRef]) -> tuple[list[np.ndarray], int]:
    """For each file, the indexes of its rows that are the latest of their result (fingerprint,
    item key, question, as 64 bits like the done-index's keys): the latest run's stamp, then the
    later file, then the later row (`latest_ordinals`); and the rows of all the files. Memory:
    24 bytes a row."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    hashes, stamps = [], []
    for ref in files:
        table = pq.read_table(pa.BufferReader(out.read(ref.key)), columns=["fingerprint", "key", "question", "run_id"])
        hashes.append(np.fromiter((result_key(f"{fp}\x1f{key}", question) for fp, key, question in zip(
            table["fingerprint"].to_pylist(), table["key"].to_pylist(), table["question"].to_pylist())),
            np.uint64, len(table)))
        stamp = pc.struct_field(pc.extract_regex(pc.fill_null(table["run_id"], ""), STAMP_IN_NAME.pattern), [0])
        stamps.append(pc.fill_null(pc.cast(pc.replace_substring(stamp, "T", ""), pa.int64()), 0).to_numpy())
    return latest_ordinals(hashes, stamps), sum(len(h) for h in hashes)


def compact_view(out: Storage) -> dict:
    """Merge the view's files into one (`parquet/compacted-<stamp>-<tag>.parquet`), a result
    held twice kept once (the latest), then remove the files merged. Reads the view, no part;
    memory: the de-duplication's 24 bytes a row, one row group and the file written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    started = time.perf_counter()
    files = view_files(out)
    if len(files) < 2:
        return {"path": out.describe(files[0].key) if files else None, "merged": [], "rows": None,
                "seconds": round(time.perf_counter() - started, 3)}
    keep, total = _latest_rows(out, files)
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
    then the files it replaces removed. Reads the whole history: for repairs (a run killed
    before its end, parts changed by hand), not for each run. The runs the view owed a file
    (killed before it) are in the new file: they are owed nothing more."""
    files = view_files(out)
    owed = [ref.key for ref in out.iter_objects(prefix="results/") if "/view-owed/" in ref.key]
    report = export_parquet(out, out, compacted_parquet_key())
    for key in [ref.key for ref in files] + owed:
        out.delete(key)
    return {**report, "replaced": [out.describe(ref.key) for ref in files]}
