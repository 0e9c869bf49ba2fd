"""Write results: one atomic Parquet part per shard, the run's manifest (last), and a
fanned-out child's report for its parent. A full disk under a folder output is one
`DiskFullError`, not retried; the write that failed left nothing behind, so a rerun skips every
part on disk."""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from pathlib import Path

from prefect import task
from prefect.cache_policies import NONE

from vlm_caption.tasks.errors import OutOfSpaceError, free_space, retry_unless_permanent
from vlm_caption.tasks.results.layout import (manifest_key, part_key, part_prefix, partition_parts_id,
                                              partition_report_key)
from vlm_caption.tasks.results.parquet import part_bytes, read_records, view_row
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.report import PartitionReport, RunStats
from vlm_caption.tasks.sources.storage import Storage


class DiskFullError(OutOfSpaceError, OSError):
    """The output's disk is full; the message names the file, the bytes needed and what to do."""


def write_object(out: Storage, key: str, data: bytes) -> None:
    """`out.write`, with a full disk turned into one clear DiskFullError."""
    try:
        out.write(key, data)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        path = out.describe(key)
        free, _ = free_space(Path(path).parent)
        error = DiskFullError(
            f"no space left on the output's disk: {path} needs {len(data)} bytes"
            + (f" and {free} are free there" if free is not None else "")
            + ". Free some space there (or choose another output), then run the same job again: the parts "
            "already written are kept and skipped.")
        error.errno = errno.ENOSPC
        raise error from None


def write_shard(out: Storage, fingerprint: str, parts_id: str, shard_index: int, records: list[ResultRecord],
                source: str, done_key: str | None = None) -> str | None:
    """One Parquet part per shard, in the view's folder of `fingerprint` (`source`: the job's
    source or manifest, the rows' column), written atomically; nothing to write, no file. Then
    `done_key`, the shard's claim marked done for the other partitions of a fan-out
    (tasks/claims.py): only after its part, so a partition that dies between the two has the
    shard redone, never lost. A failure is raised: the shard's batch tries it again, rewriting
    the whole part."""
    written = None
    if records:
        key = part_key(fingerprint, parts_id, shard_index)
        write_object(out, key, part_bytes([view_row(record, source) for record in records]))
        written = out.describe(key)
    if done_key is not None:
        write_object(out, done_key, b"")
    return written


@task(name="write-manifest", cache_policy=NONE, persist_result=False, retries=3, retry_delay_seconds=2,
      retry_condition_fn=retry_unless_permanent)
def write_manifest(out: Storage, run_id: str, manifest: dict) -> str:
    write_object(out, manifest_key(run_id), json.dumps(manifest, indent=2, default=str).encode())
    return out.describe(manifest_key(run_id))


@task(name="write-partition-report", cache_policy=NONE, persist_result=False, retries=3,
      retry_delay_seconds=2, retry_condition_fn=retry_unless_permanent)
def write_partition_report(out: Storage, run_id: str, report: PartitionReport) -> str:
    """A child run's accounting, for the parent's single manifest (flow results are not shared)."""
    write_object(out, partition_report_key(run_id, report.index), report.model_dump_json(indent=2).encode())
    return out.describe(partition_report_key(run_id, report.index))


@task(name="read-partition-reports", cache_policy=NONE, persist_result=False, retries=2)
def read_partition_reports(out: Storage, run_id: str, indexes: list[int]) -> dict[int, PartitionReport]:
    """The reports the children wrote; a child that died before writing one is simply absent."""
    return {index: PartitionReport.model_validate_json(out.read(partition_report_key(run_id, index)))
            for index in indexes if out.exists(partition_report_key(run_id, index))}


def report_from_parts(out: Storage, fingerprint: str, run_id: str, index: int,
                      retaken: Callable[[int], bool]) -> PartitionReport:
    """The counts of partition `index`, which left no report (it died), from the parts it wrote.
    Its records count as processed; a part's items as listed unless `retaken(shard)` (the
    partition that retook the shard listed them). What it skipped as already done, and its
    engine's time, are not in its parts: they stay out of the counts."""
    stats, prefix = RunStats(), part_prefix(fingerprint, partition_parts_id(run_id, index))
    for ref in out.iter_objects(prefix=prefix):
        if not ref.key.endswith(".parquet"):
            continue
        records = read_records(out, ref.key)
        shard = int(ref.key[len(prefix):].removesuffix(".parquet"))
        stats.add(0 if retaken(shard) else len({record.key for record in records}), 0, records)
        stats.parts.append(out.describe(ref.key))
    return stats.report(index, None)
