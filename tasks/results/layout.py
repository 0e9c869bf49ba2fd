"""Where results live under the output URI.

    results/<fingerprint>/part-<parts_id>-<shard>.jsonl one record per (item, question); parts_id
                                                        is the run's id, or <run_id>-p<N> for
                                                        partition N of a fanned-out run
    results/<fingerprint>/part-<parts_id>-<shard>.idx   its done-index rows (tasks/results/done_index.py)
    results/<fingerprint>/index-<stamp>.vidx           many parts' rows in one object (the same)
    manifests/<run_id>.json                             written when the run ends
    partitions/<run_id>/pNNN.json                       a fanned-out child's report
"""

import re
import time
import uuid

_PARTITION_SUFFIX = re.compile(r"-p\d+$")


def results_prefix(fingerprint: str) -> str:
    return f"results/{fingerprint}/"


def compacted_index_key(fingerprint: str) -> str:
    """Sorts by when it was written (UTC, then a random tag for loads in the same second)."""
    return f"{results_prefix(fingerprint)}index-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}.vidx"


def part_key(fingerprint: str, parts_id: str, shard_index: int) -> str:
    return f"{results_prefix(fingerprint)}part-{parts_id}-{shard_index:05d}.jsonl"


def partition_parts_id(run_id: str, index: int) -> str:
    """What partition `index` of a fanned-out run names its parts and records with (`run_id` in
    a record): which partition captioned it."""
    return f"{run_id}-p{index}"


def run_of(parts_id: str) -> str:
    """The run a record's `run_id` belongs to, whose manifest is under the run's own id."""
    return _PARTITION_SUFFIX.sub("", parts_id)


def manifest_key(run_id: str) -> str:
    return f"manifests/{run_id}.json"


def partition_report_key(run_id: str, index: int) -> str:
    return f"partitions/{run_id}/p{index:03d}.json"
