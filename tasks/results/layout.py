"""Where results live under the output URI.

    results/<fingerprint>/part-<run_id>-<shard>.jsonl   one record per (item, question)
    results/<fingerprint>/part-<run_id>-<shard>.idx     its done-index rows (tasks/results/done_index.py)
    manifests/<run_id>.json                             written when the run ends
    partitions/<run_id>/pNNN.json                       a fanned-out child's report
"""


def results_prefix(fingerprint: str) -> str:
    return f"results/{fingerprint}/"


def part_key(fingerprint: str, parts_id: str, shard_index: int) -> str:
    return f"{results_prefix(fingerprint)}part-{parts_id}-{shard_index:05d}.jsonl"


def manifest_key(run_id: str) -> str:
    return f"manifests/{run_id}.json"


def partition_report_key(run_id: str, index: int) -> str:
    return f"partitions/{run_id}/p{index:03d}.json"
