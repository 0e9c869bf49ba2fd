"""Where results live under the output URI: the keys of docs/results.md's "Layout" (the Parquet
view's files and the parts of runs not folded into it yet, manifests, partition reports)."""

import re
import time
import uuid

_PARTITION_SUFFIX = re.compile(r"-p\d+$")
_PART_NAME = re.compile(r"^part-(.+)-\d{5}\.parquet$")
PARQUET_VIEW_PREFIX = "parquet/"
VIEW_HASHES = ("done_key", "listed_hash", "content_hash")  # a view row's done-index row (done_rows.py)
RETRYABLE = "error_retryable"  # a part's column: its row is a failure the next run tries again


def parts_prefix(fingerprint: str) -> str:
    """Where the runs of `fingerprint` write their parts, inside the view: a run folds its own
    into its view file at its end and deletes them, so what is here is a killed or running run's."""
    return f"{PARQUET_VIEW_PREFIX}{fingerprint}/"


def part_prefix(fingerprint: str, parts_id: str) -> str:
    """The keys of `parts_id`'s parts (and, for a run's id, its partitions')."""
    return f"{parts_prefix(fingerprint)}part-{parts_id}-"


def part_key(fingerprint: str, parts_id: str, shard_index: int) -> str:
    return f"{part_prefix(fingerprint, parts_id)}{shard_index:05d}.parquet"


def partition_parts_id(run_id: str, index: int) -> str:
    """What partition `index` of a fanned-out run names its parts and records with (`run_id` in
    a record): which partition captioned it."""
    return f"{run_id}-p{index}"


def run_of(parts_id: str) -> str:
    """The run a record's `run_id` belongs to, whose manifest is under the run's own id."""
    return _PARTITION_SUFFIX.sub("", parts_id)


def part_run(part: str) -> str | None:
    """The run that wrote a results part (its key or name), or None for a name a run does not write."""
    found = _PART_NAME.match(part.rsplit("/", 1)[-1])
    return run_of(found.group(1)) if found else None


def run_parquet_key(run_id: str) -> str:
    return f"{PARQUET_VIEW_PREFIX}run-{run_id}.parquet"


def compacted_parquet_key() -> str:
    """Sorts by when it was written (UTC, then a random tag for two in the same second)."""
    written = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return f"{PARQUET_VIEW_PREFIX}compacted-{written}-{uuid.uuid4().hex[:8]}.parquet"


def manifest_key(run_id: str) -> str:
    return f"manifests/{run_id}.json"


def partition_report_key(run_id: str, index: int) -> str:
    return f"partitions/{run_id}/p{index:03d}.json"
