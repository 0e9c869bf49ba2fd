"""Measure the flow process's peak RSS against the number of listed items (not a test):
`python -m tests.flow_rss_scale 1024 102400 [DIR]`.

For each count: a folder of that many tiny objects, and results for every one of them already
written (parts of 64 and the run's Parquet view file, as a finished run leaves them: the
done-index reads the view file's hash columns, no part). The flow then runs in a
fresh process over the whole folder, end to end: it lists, shards, loads the done-index, runs a
prepare and a write task per shard and writes the manifest; no engine starts, since nothing is
left to caption. What grows with the listing shows in the peak RSS (no GPU needed)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTION = "Describe the content of this image in detail."
EARLIER = "ea71e000-20260101T000000"  # the finished run's id


def _job(root: Path):
    from vlm_caption.flows.params import CaptionJob

    return CaptionJob(source=str(root / "images"), output=str(root / "out"), recipe="llava",
                      model=str(root / "no-model"), skip_model_check=True, questions=[QUESTION],
                      shard_size=64)


def prepare(count: int, root: Path) -> None:
    """The objects, and a finished run's results for each (its parts, folded into its view file)."""
    from vlm_caption.flows.plan import fingerprint_of
    from vlm_caption.recipes import get_recipe
    from vlm_caption.tasks.records import ResultRecord
    from vlm_caption.tasks.results.done_index import DoneIndex
    from vlm_caption.tasks.results.parquet_view import fold_run, parts_by_run
    from vlm_caption.tasks.results.writers import write_shard
    from vlm_caption.tasks.sources.storage import open_storage

    images = root / "images"
    images.mkdir(parents=True)
    for i in range(count):
        (images / f"{i:07d}.jpg").write_bytes(b"x")
    job = _job(root)
    recipe = get_recipe(job.recipe)
    fingerprint = fingerprint_of(job, recipe, recipe.model_for(job.modality, job.model))
    objects = sorted(open_storage(str(images)).iter_objects(), key=lambda o: o.key)
    out = open_storage(job.output, create=True)
    for shard, start in enumerate(range(0, count, 64)):
        records = [ResultRecord(key=o.key, size=o.size, etag=o.etag, sha256=None, recipe="llava", model="m",
                                question=QUESTION, prompt=None, text="a caption", finish_reason="stop",
                                timings={}, fingerprint=fingerprint, run_id=EARLIER)
                   for o in objects[start:start + 64]]
        write_shard(out, fingerprint, EARLIER, shard, records, job.source)
    fold_run(out, fingerprint, EARLIER, parts_by_run(out, fingerprint)[EARLIER], DoneIndex())


def run(root: str) -> None:
    """In a fresh process: the flow over everything, then its counts and this process's peak RSS."""
    import resource

    from vlm_caption.flows.caption import vlm_caption

    began = time.perf_counter()
    summary = vlm_caption(_job(Path(root)))
    print("SCALE " + json.dumps({"listed": summary["listed"], "skipped": summary["skipped_already_done"],
                                 "processed": summary["processed"], "wall_s": round(time.perf_counter() - began, 1),
                                 "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))


def main(counts: list[int], base: Path) -> None:
    for count in counts:
        root = base / f"n{count}"
        prepare(count, root)
        done = subprocess.run([sys.executable, "-c", f"from tests.flow_rss_scale import run; run({str(root)!r})"],
                              capture_output=True, text=True)
        line = [x for x in done.stdout.splitlines() if x.startswith("SCALE ")]
        print(count, line[-1].removeprefix("SCALE ") if line else done.stderr[-3000:], flush=True)


if __name__ == "__main__":
    numbers = [int(a) for a in sys.argv[1:] if a.isdigit()]
    folder = next((a for a in sys.argv[1:] if not a.isdigit()), None)
    main(numbers, Path(folder or tempfile.mkdtemp()))
