"""Where results live under the output URI.

    results/<fingerprint>/part-<run_id>-<shard>.jsonl   one record per (item, question)
    results/<fingerprint>/part-<run_id>-<shard>.idx     its done-index rows (tasks/results/done_index.py)
    results/<fingerprint>/index-<stamp>.vidx           many parts' rows in one object (the same)
    manifests/<run_id>.json                             written when the run ends
    partitions/<run_id>/pNNN.json                       a fanned-out child's report
"""

import time
import uuid


def results_prefix(fingerprint: str) -> str:
    return f"results/{fingerprint}/"


def compacted_index_key(fingerprint: str) -> str:
    """Sorts by when it was written (UTC, then a random tag for loads in the same second)."""
    return f"{results_prefix(fingerprint)}index-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}.vidx"


def part_key(fingerprint: str, parts_id: str, shard_index: int) -> str:
    return f"{results_prefix(fingerprint)}part-{parts_id}-{shard_index:05d}.jsonl"


def manifest_key(run_id: str) -> str:
    return f"manifests/{run_id}.json"


def partition_report_key(run_id: str, index: int) -> str:
    return f"partitions/{run_id}/p{index:03d}.json"
