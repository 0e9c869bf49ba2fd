"""Measure the Parquet view's steps at scale (not a test): `python -m tests.parquet_view_scale
1000000 100 [DIR]` writes that many results over that many runs to a folder, in parts of 64
with their sidecars and the compacted done-index a run's load leaves, then times each step in a
fresh process (seconds, peak RSS): the whole view made from every part (what every run did
before the view grew by runs), a run with nothing new, a run with 1% new results, a run that
re-uploads 10 objects of the previous run (its file is rewritten), one that re-uploads 10 in the
compacted file (that file is rewritten), and a compaction."""

from __future__ import annotations

import datetime
import json
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

FP = "f" * 16
PART = 64


def run_id(day: int) -> str:
    stamp = datetime.datetime(2026, 1, 1) + datetime.timedelta(days=day)
    return f"{day:08x}-{stamp:%Y%m%dT%H%M%S}"


def _line_template() -> str:
    from vlm_caption.tasks.records import ResultRecord

    return ResultRecord(key="K", size=1000, etag="E", sha256="S" * 64, recipe="llava", model="tiny", question=None,
                        prompt="USER: <image>\nDescribe. ASSISTANT:", text="a small photo of something",
                        finish_reason="stop", prompt_tokens=70, output_tokens=8, fingerprint=FP, run_id="R",
                        timings={"fetch_s": 0.01, "decode_s": 0.01, "generate_s": 0.2}).model_dump_json()


def write_parts(store, run: str, items: range, etag: str = "e") -> tuple[list[str], dict]:
    """Parts of 64 as write_shard writes them (the body, then its sidecar), built from one record's
    JSON for speed; the parts' URIs and, per part key, (size, rows) for a compacted index."""
    from vlm_caption.tasks.results.done_rows import ROW, content_hash, result_key, sidecar_bytes, signature_hash
    from vlm_caption.tasks.results.layout import part_key

    template, uris, covered = _line_template(), [], {}
    signature, content = signature_hash(((etag, 1000),)), content_hash("S" * 64)
    for shard, start in enumerate(range(items.start, items.stop, PART)):
        keys = [f"img/{i:08d}.jpg" for i in range(start, min(start + PART, items.stop))]
        body = "".join(template.replace('"key":"K"', f'"key":"{k}"').replace('"etag":"E"', f'"etag":"{etag}"')
                       .replace('"run_id":"R"', f'"run_id":"{run}"') + "\n" for k in keys).encode()
        rows = np.array([(result_key(k, None), signature, content) for k in keys], ROW)
        key = part_key(FP, run, shard)
        store.write(key, body)
        store.write(key.removesuffix(".jsonl") + ".idx", sidecar_bytes(rows, len(body)))
        uris.append(store.describe(key))
        covered[key] = (len(body), rows)
    return uris, covered


def step(name: str, out: str, run: str = "", parts: list[str] | None = None) -> None:
    from vlm_caption.tasks.results.parquet_compact import compact_view, rebuild_view
    from vlm_caption.tasks.results.parquet_view import add_run
    from vlm_caption.tasks.sources.storage import open_storage

    store = open_storage(out)
    began = time.perf_counter()
    if name == "rebuild":
        report = rebuild_view(store)
    elif name == "compact":
        report = compact_view(store)
    else:
        report = add_run(store, FP, run, parts or [])
    print(json.dumps({"step": name, "seconds": round(time.perf_counter() - began, 2),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                      "rows": report.get("rows"), "rewritten": len(report.get("rewritten", {})),
                      "merged": len(report.get("merged", []))}), flush=True)


def _in_child(*args) -> None:
    subprocess.run([sys.executable, "-c", f"from tests.parquet_view_scale import step; step{args!r}"], check=True,
                   stderr=subprocess.DEVNULL)


def main(total: int, runs: int, out: str) -> None:
    from vlm_caption.tasks.results.done_rows import compacted_bytes
    from vlm_caption.tasks.results.layout import compacted_index_key
    from vlm_caption.tasks.sources.storage import open_storage

    store, covered, per = open_storage(out, create=True), {}, total // runs
    for day in range(runs):
        covered.update(write_parts(store, run_id(day), range(day * per, (day + 1) * per))[1])
    store.write(compacted_index_key(FP), compacted_bytes(covered))  # as the last run's load left it
    _in_child("rebuild", out)  # the view as one compacted file, as older versions made it each run
    _in_child("nothing new", out, run_id(runs), [])
    parts, _ = write_parts(store, run_id(runs), range(total, total + total // 100))
    _in_child("1% new", out, run_id(runs), parts)
    parts, _ = write_parts(store, run_id(runs + 1), range(total, total + 10), etag="changed")
    _in_child("10 re-uploaded, in a run's file", out, run_id(runs + 1), parts)
    parts, _ = write_parts(store, run_id(runs + 2), range(0, 10), etag="changed")
    _in_child("10 re-uploaded, in the compacted file", out, run_id(runs + 2), parts)
    _in_child("compact", out)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else tempfile.mkdtemp())
