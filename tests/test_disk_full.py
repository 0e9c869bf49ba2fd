"""A folder output on a small disk that fills up mid-run: the run stops with one clear error
naming the file and the bytes it needed; every part left on the disk is whole (nothing partial
is counted); once space is freed, the same job run again completes, each item once.

The disk is a real 1 MiB tmpfs (we are root in CI), mostly taken by a filler file so that a few
parts fit and the next one does not. Where mounting is not permitted the test is skipped."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.params import CaptionJob
from vlm_caption.tasks.results.layout import part_run
from vlm_caption.tasks.results.writers import DiskFullError
from tests.images import image_bytes
from tests.result_files import records as result_records

COUNT = 24
ROOM = 24 * 1024  # what the filler leaves free: a few parts (each takes a 4 KiB page; the run's empty mark none)


@pytest.fixture
def small_disk(tmp_path):
    folder = tmp_path / "small-disk"
    folder.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("mounting a 1 MiB tmpfs needs root (and a container that permits mount)")
    yield folder
    subprocess.run(["umount", str(folder)], check=False)


def _fill(disk: Path, leave: int) -> Path:
    filler = disk / ".filler"  # a dot file: no listing of the output sees it
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    filler.write_bytes(b"\0" * max(0, free - leave))
    return filler


def _parts(out: Path) -> dict[Path, int]:
    """Every results part on the disk not folded into the view yet, with its rows (a part cut
    short fails to read here)."""
    return {path: pq.read_table(path).num_rows for path in sorted(out.glob("parquet/*/part-*.parquet"))}


def test_a_full_disk_stops_the_run_and_a_rerun_completes(prefect_api, tiny_llava, tmp_path, small_disk):
    source = tmp_path / "images"
    source.mkdir()
    hashes = {}
    for i in range(COUNT):
        body = image_bytes(size=(40 + i, 32), color=(i * 9 % 255, 60, 120))
        (source / f"{i:03d}.jpg").write_bytes(body)
        hashes[f"{i:03d}.jpg"] = hashlib.sha256(body).hexdigest()
    out = small_disk / "captions"
    job = CaptionJob(source=str(source), output=str(out), model=str(tiny_llava), shard_size=2,
                     sampling={"max_tokens": 2})
    filler = _fill(small_disk, ROOM)

    with pytest.raises(DiskFullError) as stopped:
        vlm_caption(job)
    message = str(stopped.value)
    assert str(out) in message and "bytes" in message and "run the same job again" in message, message

    partial = _parts(out)
    assert 0 < len(partial) < COUNT // 2, "the disk never filled (lower ROOM) or filled at once (raise it)"
    assert not [p for p in out.rglob(".*")], "a temporary file was left behind"
    # Only the parts (the run stopped before folding them into its view file): no sidecar, no
    # index, no stamp; and no view file.
    assert len({part.parent.name for part in partial}) == 1  # one fingerprint
    files = {path.relative_to(out) for path in (out / "parquet").rglob("*") if path.is_file()}
    assert files == {part.relative_to(out) for part in partial}, files
    (stopped_run,) = {part_run(part.name) for part in partial}
    assert not list(out.glob("parquet/*.parquet"))
    done_before = sum(partial.values())

    filler.unlink()  # space is freed
    summary = vlm_caption(job)
    records = result_records(out)
    assert Counter(r["key"] for r in records) == Counter(list(hashes))  # every item once: none lost, none twice
    assert all(r["error"] is None and r["sha256"] == hashes[r["key"]] for r in records)
    assert summary["skipped_already_done"] == done_before and summary["failed"] == 0, summary
    # The rerun added the stopped run's view file (from its parts), then its own: no part is left
    # unfolded and the view holds every item once, and the rerun's manifest says so.
    assert not _parts(out), _parts(out)
    view = [key for path in sorted(out.glob("parquet/*.parquet")) for key in pq.read_table(path).column("key").to_pylist()]
    assert sorted(view) == sorted(hashes), view
    parquet = json.loads((out / "manifests" / f"{summary['run_id']}.json").read_text())["parquet"]
    assert parquet["complete"] and set(parquet["repaired"]) == {stopped_run}, parquet


def test_a_full_disk_at_a_part_is_one_clear_error_and_leaves_nothing(tmp_path):
    """A disk with no room for a shard's part (no inode left, a quota) stops the run with one
    DiskFullError naming the part and saying what to do, and nothing of the shard is written."""
    import errno

    from vlm_caption.tasks.records import ResultRecord
    from vlm_caption.tasks.results.writers import write_shard
    from vlm_caption.tasks.sources.storage import open_storage

    out = open_storage(str(tmp_path / "out"), create=True)

    def write(key: str, data: bytes) -> None:
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    out.write = write
    record = ResultRecord(key="a.jpg", size=1, etag="e", sha256=None, recipe="r", model="m", prompt=None,
                          text="a cat", finish_reason="stop", timings={}, fingerprint="f" * 16, run_id="run-full")
    with pytest.raises(DiskFullError) as stopped:
        write_shard(out, "f" * 16, "run-full", 0, [record], "photos/")
    assert "part-run-full-00000.parquet" in str(stopped.value) and "run the same job again" in str(stopped.value)
    assert not [path for path in (tmp_path / "out").rglob("*") if path.is_file()]
