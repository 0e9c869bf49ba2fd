"""Measure the Parquet view's steps at scale (not a test): `python -m tests.parquet_view_scale
1000000 100 [DIR]` writes that many results over that many runs to a folder, in parts of 64
(as killed runs leave them), then times each step in a fresh process (seconds, peak RSS): the
whole view made from every part (`vlm-caption export OUTPUT`: each run's parts folded, then one
compacted file), a run with nothing new, a run with 1% new results, a run that re-uploads 10 objects of
the previous run (its file is rewritten), one that re-uploads 10 in the compacted file (that
file is rewritten), and a compaction. Each run's step loads the done-index itself (none was
loaded in its process), reading the view's hash columns, as a run does at its start."""

from __future__ import annotations

import datetime
import json
import resource
import subprocess
import sys
import tempfile
import time

FP = "f" * 16
PART = 64


def run_id(day: int) -> str:
    stamp = datetime.datetime(2026, 1, 1) + datetime.timedelta(days=day)
    return f"{day:08x}-{stamp:%Y%m%dT%H%M%S}"


def write_parts(store, run: str, items: range, etag: str = "e") -> None:
    """Parts of 64, as write_shard writes them."""
    from vlm_caption.tasks.records import ResultRecord
    from vlm_caption.tasks.results.writers import write_shard

    template = ResultRecord(key="K", size=1000, etag=etag, sha256="S" * 64, recipe="llava", model="tiny",
                            question=None, prompt="USER: <image>\nDescribe. ASSISTANT:",
                            text="a small photo of something", finish_reason="stop", prompt_tokens=70,
                            output_tokens=8, fingerprint=FP, run_id=run,
                            timings={"fetch_s": 0.01, "decode_s": 0.01, "generate_s": 0.2})
    for shard, start in enumerate(range(items.start, items.stop, PART)):
        records = [template.model_copy(update={"key": f"img/{i:08d}.jpg"})
                   for i in range(start, min(start + PART, items.stop))]
        write_shard(store, FP, run, shard, records, "scale/")


def step(name: str, out: str, run: str = "") -> None:
    from vlm_caption.tasks.results.parquet_view import compact_view, export_after_run, rebuild_view
    from vlm_caption.tasks.sources.storage import open_storage

    store = open_storage(out)
    began = time.perf_counter()
    if name == "rebuild":
        report = rebuild_view(store)
    elif name == "compact":
        report = compact_view(store)
    else:
        report = export_after_run.fn(store, out, FP, run)
    print(json.dumps({"step": name, "seconds": round(time.perf_counter() - began, 2),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                      "rows": report.get("rows"), "rewritten": len(report.get("rewritten", {})),
                      "merged": len(report.get("merged", []))}), flush=True)


def _in_child(*args) -> None:
    subprocess.run([sys.executable, "-c", f"from tests.parquet_view_scale import step; step{args!r}"], check=True,
                   stderr=subprocess.DEVNULL)


def main(total: int, runs: int, out: str) -> None:
    from vlm_caption.tasks.sources.storage import open_storage

    store, per = open_storage(out, create=True), total // runs
    for day in range(runs):
        write_parts(store, run_id(day), range(day * per, (day + 1) * per))
    _in_child("rebuild", out)  # the view as one compacted file, made from every part
    _in_child("nothing new", out, run_id(runs))
    write_parts(store, run_id(runs), range(total, total + total // 100))
    _in_child("1% new", out, run_id(runs))
    write_parts(store, run_id(runs + 1), range(total, total + 10), etag="changed")
    _in_child("10 re-uploaded, in a run's file", out, run_id(runs + 1))
    write_parts(store, run_id(runs + 2), range(0, 10), etag="changed")
    _in_child("10 re-uploaded, in the compacted file", out, run_id(runs + 2))
    _in_child("compact", out)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else tempfile.mkdtemp())
