"""Measure the done-index at scale (not a test): `python -m tests.done_index_scale 1000000 [DIR]`
writes that many results in parts of 64 to a folder, then the run's Parquet view file (as a
finished run leaves them), and loads them in a fresh process, printing seconds and peak RSS: the
load reads the view file's fingerprint and hash columns, no part. With `--no-view` no view file is
written (a first run's history, or a view deleted by hand): the load parses every part. With
`--s3` the folder is uploaded to a loopback moto S3 server (a process of its own, as the bench
runs it) and loaded from there (the view file's columns by ranged reads)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time

FP = "f" * 16
RUN = "5ca1e000-20260101T000000"


def load(out: str) -> None:
    from vlm_caption.tasks.results.done_index import load_done_index
    from vlm_caption.tasks.sources.storage import open_storage

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    done = load_done_index.fn(open_storage(out, create=True), FP)
    print(json.dumps({"records": len(done), "load_s": round(time.perf_counter() - began, 2),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                      "rss_before_load_mb": before // 1024, "index_mb": round(done.nbytes / 2**20, 1)}))


def prepare(total: int, out: str, view: bool) -> None:
    """The results' parts, folded into the run's view file unless `view` is false (a killed run's)."""
    from tests.test_done_index import _record
    from vlm_caption.tasks.results.done_index import DoneIndex
    from vlm_caption.tasks.results.parquet_view import fold_run, parts_by_run
    from vlm_caption.tasks.results.writers import write_shard
    from vlm_caption.tasks.sources.storage import open_storage

    store = open_storage(out, create=True)
    for shard, start in enumerate(range(0, total, 64)):
        write_shard(store, FP, RUN, shard, [_record(i) for i in range(start, min(start + 64, total))], "scale/")
    if view:
        began = time.perf_counter()
        added = fold_run(store, FP, RUN, parts_by_run(store, FP)[RUN], DoneIndex())
        print(json.dumps({"view_file": added["path"], "rows": added["rows"],
                          "fold_s": round(time.perf_counter() - began, 1)}))


def main(total: int, out: str, s3: bool = False, view: bool = True) -> None:
    # Each step in a process of its own: a child's peak RSS starts from its parent's RSS, kept small here.
    _in_child(f"prepare({total}, {out!r}, {view})", {})
    if not s3:
        _in_child(f"load({out!r})", {})
        return
    import os
    from pathlib import Path

    from vlm_caption.bench.harness import s3_source

    with s3_source(Path(out), Path(tempfile.mkdtemp())) as env:
        uri = {**os.environ, **env}["VLM_CAPTION_BENCH_S3"].rstrip("/") + "/images/"  # where it uploaded
        _in_child(f"load({uri!r})", env)


def _in_child(call: str, env: dict[str, str]) -> None:
    import os

    subprocess.run([sys.executable, "-c", f"from tests.done_index_scale import load, prepare; {call}"],
                   check=True, env={**os.environ, **env})


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(int(args[0]), args[1] if len(args) > 1 else tempfile.mkdtemp(), s3="--s3" in sys.argv,
         view="--no-view" not in sys.argv)
