"""Measure the done-index at scale (not a test): `python -m tests.done_index_scale 1000000 [DIR]`
writes that many results in parts of 64 (with sidecars) to a folder, then loads them in a
fresh process and prints seconds and peak RSS. With `--s3` the folder is uploaded to a loopback
moto S3 server (a process of its own, as the bench runs it) and loaded from there, twice: the
first load reads every sidecar and writes the compacted index, the second reads that."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time


def load(out: str) -> None:
    from vlm_caption.tasks.results.done_index import load_done_index
    from vlm_caption.tasks.sources.storage import open_storage

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    done = load_done_index.fn(open_storage(out, create=True), "f" * 16)
    print(json.dumps({"records": len(done), "load_s": round(time.perf_counter() - began, 2),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                      "rss_before_load_mb": before // 1024, "index_mb": round(done.nbytes / 2**20, 1)}))


def main(total: int, out: str, s3: bool = False) -> None:
    from tests.test_done_index import _record
    from vlm_caption.tasks.results.writers import write_shard
    from vlm_caption.tasks.sources.storage import open_storage

    store = open_storage(out, create=True)
    for shard, start in enumerate(range(0, total, 64)):
        write_shard(store, "f" * 16, "scale", shard, [_record(i) for i in range(start, min(start + 64, total))])
    if not s3:
        _load_in_child(out, {})
        return
    import os
    from pathlib import Path

    from vlm_caption.bench.harness import s3_source

    with s3_source(Path(out), Path(tempfile.mkdtemp())) as env:
        uri = {**os.environ, **env}["VLM_CAPTION_BENCH_S3"].rstrip("/") + "/images/"  # where it uploaded
        for _ in range(2):  # every sidecar, then the compacted index
            _load_in_child(uri, env)


def _load_in_child(uri: str, env: dict[str, str]) -> None:
    import os

    subprocess.run([sys.executable, "-c", f"from tests.done_index_scale import load; load({uri!r})"],
                   check=True, env={**os.environ, **env})


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--s3"]
    main(int(args[0]), args[1] if len(args) > 1 else tempfile.mkdtemp(), s3="--s3" in sys.argv)
