"""Where the last complete listing of a bucket ended (tasks/sources/watermark.py): kept in the
output per job and scope, and the next run's look past it on S3, one page after the key."""

from __future__ import annotations

import json
from types import SimpleNamespace

import vlm_caption.tasks.sources.watermark as listing_end
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.watermark import keep_listing_end, listing_end_key, object_after_listing_end
from vlm_caption.tasks.sources.storage import open_storage

BUCKET = "night"


def test_the_next_run_looks_past_the_greatest_key_listed(s3_client, monkeypatch):
    s3_client.create_bucket(Bucket=BUCKET)
    for key in ("media/2026-11-26/a.jpg", "media/2026-11-27/a.jpg", "media/2026-11-27/notes.txt"):
        s3_client.put_object(Bucket=BUCKET, Key=key, Body=b"x")
    output = open_storage(f"s3://{BUCKET}/out/", create=True)
    source, photos = SourceSpec(f"s3://{BUCKET}/media/"), SourceSpec(f"s3://{BUCKET}/media/", glob="*.jpg")
    assert object_after_listing_end(output, source, "fp") is None  # no listing kept yet

    keep_listing_end(output, source, "fp", "2026-11-27/notes.txt")
    keep_listing_end(output, photos, "fp", "2026-11-27/a.jpg")
    assert listing_end_key(source, "fp") != listing_end_key(photos, "fp")  # another glob lists other objects
    assert json.loads(output.read(listing_end_key(source, "fp")))["greatest_key"] == "2026-11-27/notes.txt"
    assert object_after_listing_end(output, source, "fp") is None
    assert object_after_listing_end(output, source, "another-job") is None

    s3_client.put_object(Bucket=BUCKET, Key="media/2026-11-27/b.jpg", Body=b"x")  # among the listed keys
    assert object_after_listing_end(output, source, "fp") is None
    s3_client.put_object(Bucket=BUCKET, Key="media/2026-11-28/c.txt", Body=b"x")
    s3_client.put_object(Bucket=BUCKET, Key="media/2026-11-28/d.jpg", Body=b"x")
    assert object_after_listing_end(output, source, "fp") == "2026-11-28/c.txt"
    # the photos' listing ended at a.jpg: b.jpg came after it for them, and c.txt is not theirs
    assert object_after_listing_end(output, photos, "fp") == "2026-11-27/b.jpg"

    # a kept end that does not parse, or a source not listed by key: no hint, the run goes on as before
    output.write(listing_end_key(source, "fp"), b"{not json")
    said = []
    monkeypatch.setattr(listing_end, "get_logger", lambda **fields: SimpleNamespace(
        warning=lambda event, **kw: said.append(event)))
    assert object_after_listing_end(output, source, "fp") is None
    assert said == ["could not look past where the last listing ended"]
    manifest = SourceSpec(f"s3://{BUCKET}/jobs.jsonl", format="manifest")
    keep_listing_end(output, manifest, "fp", "z")
    assert not s3_client.list_objects_v2(Bucket=BUCKET, Prefix=f"out/{listing_end_key(manifest, 'fp')}").get("Contents")
    assert object_after_listing_end(output, manifest, "fp") is None
