"""--modified-since: a time, a duration or `auto` lists only the objects modified after it (a
folder's and a bucket's listing, an inventory report's rows); a value that is none of these is
one line and exit 2; and `auto` over two flow runs: the second lists only what is new, plus the
item that failed retryably in the first, which is captioned then; a run cut by `limit` leaves
the watermark where it was."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import pytest

from vlm_caption.flows.cli import main
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.inventory import InventoryReader
from vlm_caption.tasks.sources.listing import iter_items
from vlm_caption.tasks.sources.storage import open_storage
from vlm_caption.tasks.sources.watermark import check_modified_since, resolve_modified_since, with_changed_since
from tests.images import image_bytes
from tests.result_files import records as _records
from tests.test_inventory_source import bucket_rows, write_report

DAY = 86400


def _image(path: Path, age_s: float, color=(10, 20, 30)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(image_bytes(color=color))
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_a_time_a_duration_or_auto(tmp_path: Path, capsys):
    assert resolve_modified_since("26h", now=1_800_000_000) == "2027-01-14T06:00:00Z"  # 1.8e9 s less 26 hours
    assert resolve_modified_since("2026-11-20") == "2026-11-20T00:00:00Z"  # no zone: UTC
    assert resolve_modified_since("2026-11-20T03:00:00+01:00") == "2026-11-20T02:00:00Z"
    assert check_modified_since("auto") == "auto" and check_modified_since(" 2d ") == "2d"
    with pytest.raises(ValueError, match="not a time"):
        check_modified_since("yesterday")

    code = main(["run", str(tmp_path), "--out", str(tmp_path / "out"), "--modified-since", "yesterday"])
    assert code == 2
    assert "modified_since: 'yesterday' is not a time (2026-11-20 or 2026-11-20T03:00:00Z), a duration " \
        "(26h, 90m, 2d, 1w) or auto" in capsys.readouterr().err
    code = main(["run", str(tmp_path), "--source-format", "parquet", "--out", str(tmp_path / "out"),
                 "--modified-since", "2d"])
    assert code == 2
    assert "modified_since is for a folder or bucket of media files and S3 Inventory reports" in capsys.readouterr().err


def test_a_time_leaves_out_what_is_older(tmp_path: Path, s3_client):
    for name, age in (("old.jpg", 3 * DAY), ("sub/old.jpg", 3 * DAY), ("new.jpg", 60), ("sub/new.jpg", 60)):
        _image(tmp_path / "src" / name, age)
    out = open_storage(str(tmp_path / "out"), create=True)
    since = resolve_modified_since("1d")
    folder = with_changed_since(SourceSpec(str(tmp_path / "src")), since, out, "fp")
    assert sorted(item.id for item in iter_items(folder)) == ["new.jpg", "sub/new.jpg"]
    groups = with_changed_since(SourceSpec(str(tmp_path / "src"), "multi-image"), since, out, "fp")
    assert [(i.id, len(i.members)) for i in iter_items(groups)] == [(".", 2), ("sub", 2)]  # whole groups
    assert not list(iter_items(with_changed_since(SourceSpec(str(tmp_path / "src")), "2099-01-01", out, "fp")))

    # A bucket's listing, and an inventory report's rows, by their objects' LastModified.
    s3_client.create_bucket(Bucket="since-src")
    s3_client.create_bucket(Bucket="since-reports")
    for key in ("a.jpg", "b.jpg", "c.jpg"):
        s3_client.put_object(Bucket="since-src", Key=key, Body=image_bytes())
    rows = bucket_rows(s3_client, "since-src")
    for row in rows:
        if row["key"] == "b.jpg":  # as if uploaded three days ago
            row["modified"] -= datetime.timedelta(days=3)
    manifest = write_report(s3_client, rows, source="since-src", dest="since-reports")
    report = with_changed_since(InventoryReader.spec_for(manifest), since, out, "fp")
    assert sorted(item.id for item in iter_items(report)) == ["a.jpg", "c.jpg"]
    bucket = with_changed_since(SourceSpec("s3://since-src/"), since, out, "fp")
    assert sorted(item.id for item in iter_items(bucket)) == ["a.jpg", "b.jpg", "c.jpg"]  # all uploaded now


def test_auto_lists_what_is_new_and_what_failed_retryably(prefect_api, tiny_llava, tmp_path: Path, monkeypatch):
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob
    from vlm_caption.tasks.sources.reader import SourceReader

    src, out = tmp_path / "src", tmp_path / "out"
    for i, name in enumerate(("a.jpg", "b.jpg", "c.jpg", "flaky.jpg")):
        _image(src / name, 3 * DAY, color=(i * 60, 10, 10))
    job = CaptionJob(source=str(src), output=str(out), model=str(tiny_llava), shard_size=2,
                     sampling={"max_tokens": 6}, gallery_items=0, modified_since="auto")
    real_read = SourceReader.read_member

    def flaky(self, ref):
        if ref.key == "flaky.jpg":
            raise ConnectionError("connection reset by peer (test)")
        return real_read(self, ref)

    with monkeypatch.context() as patch:
        patch.setattr(SourceReader, "read_member", flaky)
        first = vlm_caption(job)
    assert (first["listed"], first["succeeded"], first["failed"]) == (4, 3, 1)  # no watermark yet: everything
    watermark = json.loads(next((out / "watermarks").glob(f"{first['fingerprint']}-*.json")).read_text())
    assert watermark["retry"] == ["flaky.jpg"]
    moved_to = datetime.datetime.fromisoformat(watermark["modified_after"]).timestamp()
    assert time.time() - 2 * DAY < moved_to < time.time() - DAY + 60  # the run's start, less a day

    _image(src / "new.jpg", 0, color=(1, 200, 1))
    _image(src / "late.jpg", 3 * DAY, color=(1, 1, 200))  # older than the watermark: not listed
    second = vlm_caption(job)
    assert (second["listed"], second["processed"], second["succeeded"]) == (2, 2, 2)
    records = _records(out)
    assert {r["key"]: r["error"] for r in records if r["run_id"] == second["run_id"]} == \
        {"flaky.jpg": None, "new.jpg": None}
    assert "late.jpg" not in {r["key"] for r in records}
    manifest = json.loads((out / "manifests" / f"{second['run_id']}.json").read_text())
    assert manifest["watermark"]["moved"] and manifest["watermark"]["retry"] == 0

    kept = next((out / "watermarks").glob("*.json")).read_text()
    cut = vlm_caption(job.model_copy(update={"limit": 1}))
    assert json.loads((out / "manifests" / f"{cut['run_id']}.json").read_text())["watermark"]["moved"] is False
    assert next((out / "watermarks").glob("*.json")).read_text() == kept
