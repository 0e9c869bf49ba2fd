"""Write results: one atomic JSON Lines part per shard, the run's manifest (last), and a
fanned-out child's report for its parent."""

from __future__ import annotations

import json

from prefect import task
from prefect.cache_policies import NONE

from tasks.results.done_index import index_rows, sidecar_bytes, sidecar_key
from tasks.results.layout import manifest_key, part_key, partition_report_key
from tasks.results.records import ResultRecord
from tasks.results.report import PartitionReport
from tasks.sources.storage import open_storage


@task(name="write-shard", cache_policy=NONE, persist_result=False, retries=3, retry_delay_seconds=2)
def write_shard(output_uri: str, fingerprint: str, parts_id: str, shard_index: int,
                records: list[ResultRecord]) -> str | None:
    """One JSON Lines file per shard, written atomically, then its done-index sidecar (a part
    whose sidecar is missing is parsed instead). Nothing to write, no file."""
    if not records:
        return None
    out = open_storage(output_uri, create=True)
    key = part_key(fingerprint, parts_id, shard_index)
    body = "".join(record.model_dump_json() + "\n" for record in records).encode()
    out.write(key, body)
    out.write(sidecar_key(key), sidecar_bytes(index_rows(records), len(body)))
    return out.describe(key)


@task(name="write-manifest", cache_policy=NONE, persist_result=False, retries=3, retry_delay_seconds=2)
def write_manifest(output_uri: str, run_id: str, manifest: dict) -> str:
    out = open_storage(output_uri, create=True)
    out.write(manifest_key(run_id), json.dumps(manifest, indent=2, default=str).encode())
    return out.describe(manifest_key(run_id))


@task(name="write-partition-report", cache_policy=NONE, persist_result=False, retries=3,
      retry_delay_seconds=2)
def write_partition_report(output_uri: str, run_id: str, report: PartitionReport) -> str:
    """A child run's accounting, for the parent's single manifest (flow results are not shared)."""
    out = open_storage(output_uri, create=True)
    out.write(partition_report_key(run_id, report.index), report.model_dump_json(indent=2).encode())
    return out.describe(partition_report_key(run_id, report.index))


@task(name="read-partition-reports", cache_policy=NONE, persist_result=False, retries=2)
def read_partition_reports(output_uri: str, run_id: str, indexes: list[int]) -> dict[int, PartitionReport]:
    """The reports the children wrote; a child that died before writing one is simply absent."""
    out = open_storage(output_uri, create=True)
    return {index: PartitionReport.model_validate_json(out.read(partition_report_key(run_id, index)))
            for index in indexes if out.exists(partition_report_key(run_id, index))}
