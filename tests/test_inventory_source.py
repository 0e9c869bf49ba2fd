"""An S3 Inventory report as a source: a report written as AWS lays it out (manifest.json, then
gzip CSV or Parquet data files under data/, into the loopback S3) lists the same items as a
listing of its bucket; delete markers, older versions and folder markers are left out; a copy of
the report in a local folder reads the same; a report that cannot be used is one message saying
what to change; and a flow run over the report gives the records of a run over the bucket,
interchangeable with them (a rerun over the report finds the listing's results done)."""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import uuid
from pathlib import Path
from urllib.parse import quote_plus

import pytest

from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.inventory import InventoryReader
from vlm_caption.tasks.sources.listing import iter_items
from vlm_caption.tasks.sources.registry import detect_format
from vlm_caption.tasks.sources.storage import StorageError
from tests.images import corrupt_jpeg, image_bytes
from tests.result_files import records as _records

SOURCE, DEST, PREFIX, CONFIG = "inv-src", "inv-dest", "inventory", "nightly"
CSV_SCHEMA = "Bucket, Key, VersionId, IsLatest, IsDeleteMarker, Size, LastModifiedDate, ETag, StorageClass"
PARQUET_SCHEMA = ("message s3.inventory { required binary bucket (UTF8); required binary key (UTF8); optional binary "
                  "version_id (UTF8); optional boolean is_latest; optional boolean is_delete_marker; optional int64 "
                  "size; optional int64 last_modified_date (TIMESTAMP_MILLIS); optional binary e_tag (UTF8); "
                  "optional binary storage_class (UTF8); }")


def upload_objects(s3_client, bucket: str) -> dict[str, bytes]:
    s3_client.create_bucket(Bucket=bucket)
    objects = {f"images/{i:02d}.{('jpg', 'png')[i % 2]}": image_bytes(("JPEG", "PNG")[i % 2], size=(64 + i, 48),
                                                                    color=(i * 40 % 256, 90, 200)) for i in range(6)}
    objects.update({"images/sub/a b+c.jpg": image_bytes("JPEG", color=(1, 2, 3)), "top.png": image_bytes("PNG"),
                    "images/notes.txt": b"not an image", "images/": b""})
    for key, body in objects.items():
        s3_client.put_object(Bucket=bucket, Key=key, Body=body)
    return objects


def bucket_rows(s3_client, bucket: str) -> list[dict]:
    """What S3 Inventory reports of the bucket: each object as the latest version, plus an older
    version of one and a delete marker (both to be left out)."""
    listed = s3_client.list_objects_v2(Bucket=bucket)["Contents"]
    rows = [{"key": o["Key"], "size": o["Size"], "etag": o["ETag"].strip('"'), "modified": o["LastModified"],
             "latest": True, "deleted": False} for o in listed]
    old = dict(rows[0], size=rows[0]["size"] + 1, etag="0" * 32, latest=False)
    gone = dict(rows[0], key="images/gone.jpg", size=None, etag="", latest=True, deleted=True)
    return list(reversed(rows)) + [old, gone]  # not in key order: a report's order is its own


def write_report(s3_client, rows: list[dict], *, fmt: str = "CSV", date: str = "2026-11-27T01-00Z",
                 source: str = SOURCE, dest: str = DEST, files: int = 2) -> str:
    """The report as AWS writes it into the destination bucket; returns its manifest's URI."""
    config = f"{PREFIX}/{source}/{CONFIG}/"
    entries = []
    for part in range(files):
        chunk = rows[part::files]
        body = _csv_gz(chunk, source) if fmt == "CSV" else _parquet(chunk, source)
        key = f"{config}data/{uuid.uuid4()}.{'csv.gz' if fmt == 'CSV' else 'parquet'}"
        s3_client.put_object(Bucket=dest, Key=key, Body=body)
        entries.append({"key": key, "size": len(body), "MD5checksum": hashlib.md5(body).hexdigest()})
    manifest = json.dumps({"sourceBucket": source, "destinationBucket": f"arn:aws:s3:::{dest}", "version": "2016-11-30",
                           "creationTimestamp": "1795741200000", "fileFormat": fmt,
                           "fileSchema": CSV_SCHEMA if fmt == "CSV" else PARQUET_SCHEMA, "files": entries}).encode()
    s3_client.put_object(Bucket=dest, Key=f"{config}{date}/manifest.json", Body=manifest)
    s3_client.put_object(Bucket=dest, Key=f"{config}{date}/manifest.checksum", Body=hashlib.md5(manifest).hexdigest())
    return f"s3://{dest}/{config}{date}/manifest.json"


def _csv_gz(rows: list[dict], bucket: str) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text, quoting=csv.QUOTE_ALL, lineterminator="\n")
    for r in rows:  # keys form-URL-encoded, as in AWS's CSV reports
        writer.writerow([bucket, quote_plus(r["key"]), "v1", str(r["latest"]).lower(), str(r["deleted"]).lower(),
                         "" if r["size"] is None else r["size"],
                         r["modified"].strftime("%Y-%m-%dT%H:%M:%S.") + f"{r['modified'].microsecond // 1000:03d}Z",
                         r["etag"], "STANDARD"])
    return gzip.compress(text.getvalue().encode())


def _parquet(rows: list[dict], bucket: str) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"bucket": [bucket] * len(rows), "key": [r["key"] for r in rows],
                      "version_id": ["v1"] * len(rows), "is_latest": [r["latest"] for r in rows],
                      "is_delete_marker": [r["deleted"] for r in rows],
                      "size": pa.array([r["size"] for r in rows], pa.int64()),
                      "last_modified_date": pa.array([r["modified"] for r in rows], pa.timestamp("ms", tz="UTC")),
                      "e_tag": [r["etag"] for r in rows], "storage_class": ["STANDARD"] * len(rows)})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="snappy")
    return sink.getvalue()


def _seen(items) -> list[tuple]:
    return sorted((i.id, tuple((m.key, m.size, m.etag, round(m.last_modified, 3)) for m in i.members)) for i in items)


def checked(location: str) -> SourceSpec:
    """The spec pre-flight makes of a location: its report found and checked."""
    return InventoryReader(InventoryReader.spec_for(location)).check()


@pytest.mark.parametrize("fmt", ["CSV", "Parquet"])
def test_a_report_lists_what_a_listing_lists(s3_client, tmp_path: Path, fmt: str):
    upload_objects(s3_client, SOURCE)
    s3_client.create_bucket(Bucket=DEST)
    rows = bucket_rows(s3_client, SOURCE)
    write_report(s3_client, rows[:3], fmt=fmt, date="2026-11-26T01-00Z")  # yesterday's, smaller
    manifest = write_report(s3_client, rows, fmt=fmt)

    # The configuration's folder names its newest report; the manifest says where the objects are.
    assert checked(f"s3://{DEST}/{PREFIX}/{SOURCE}/{CONFIG}/").uri == manifest
    assert detect_format(manifest, "auto", False) == "inventory"
    report = InventoryReader.spec_for(manifest)
    assert report.base == f"s3://{SOURCE}/" and report.storage.uri == f"s3://{SOURCE}/"
    listing = SourceSpec(f"s3://{SOURCE}/", "image")
    assert len(_seen(iter_items(report))) == 9  # no older version, delete marker or folder marker
    assert _seen(iter_items(report)) == _seen(iter_items(listing))
    for glob in ("*.jpg", "images/sub/*"):
        assert _seen(iter_items(InventoryReader.spec_for(manifest, glob=glob))) == \
            _seen(iter_items(SourceSpec(f"s3://{SOURCE}/", "image", glob=glob)))
    assert _seen(iter_items(InventoryReader.spec_for(manifest, modality="multi-image"))) == \
        _seen(iter_items(SourceSpec(f"s3://{SOURCE}/", "multi-image")))

    # A copy of the report in a local folder (its dated folder and data/ beside it) reads the same.
    for obj in s3_client.list_objects_v2(Bucket=DEST)["Contents"]:
        path = tmp_path / "copy" / obj["Key"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(s3_client.get_object(Bucket=DEST, Key=obj["Key"])["Body"].read())
    local = checked(str(tmp_path / "copy" / manifest.removeprefix(f"s3://{DEST}/")))
    assert _seen(iter_items(local)) == _seen(iter_items(listing))


def test_a_report_that_cannot_be_used_says_what_to_change(s3_client, tmp_path: Path):
    upload_objects(s3_client, "inv-bad")
    s3_client.create_bucket(Bucket="inv-bad-dest")
    rows = bucket_rows(s3_client, "inv-bad")
    manifest = write_report(s3_client, rows, source="inv-bad", dest="inv-bad-dest", files=1)
    key = manifest.removeprefix("s3://inv-bad-dest/")
    doc = json.loads(s3_client.get_object(Bucket="inv-bad-dest", Key=key)["Body"].read())

    def rewrite(**changes) -> None:
        s3_client.put_object(Bucket="inv-bad-dest", Key=key, Body=json.dumps({**doc, **changes}).encode())

    rewrite(fileFormat="ORC")
    with pytest.raises(StorageError, match="a ORC report; vlm-caption reads CSV and Parquet inventory reports"):
        checked(manifest)
    rewrite(fileSchema="Bucket, Key, Size, LastModifiedDate")
    with pytest.raises(StorageError, match="the report has no ETag field; add Size and ETag"):
        checked(manifest)
    with pytest.raises(StorageError, match="no S3 Inventory report there"):
        checked(str(tmp_path))
    # A data file that is not what the manifest says (replaced, cut) stops the listing, naming it.
    rewrite(files=[dict(doc["files"][0], MD5checksum="0" * 32)])
    with pytest.raises(StorageError, match="the inventory manifest says 0{32}; the report is damaged or was replaced"):
        list(iter_items(checked(manifest)))
    short = gzip.compress(b'"inv-bad","a.jpg"\n')  # fewer columns than the fileSchema names
    s3_client.put_object(Bucket="inv-bad-dest", Key=doc["files"][0]["key"], Body=short)
    rewrite(files=[dict(doc["files"][0], size=len(short), MD5checksum=hashlib.md5(short).hexdigest())])
    with pytest.raises(StorageError, match=r"line 1: not a row of the manifest's fileSchema \(Bucket, Key, VersionId"):
        list(iter_items(checked(manifest)))


def test_a_flow_over_a_report_gives_the_records_of_a_listing(prefect_api, s3_client, tiny_llava, tmp_path: Path):
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob

    s3_client.create_bucket(Bucket="inv-flow")
    for i in range(5):
        s3_client.put_object(Bucket="inv-flow", Key=f"pics/{i}.jpg", Body=image_bytes(color=(i * 50, 20, 90)))
    s3_client.put_object(Bucket="inv-flow", Key="pics/broken.jpg", Body=corrupt_jpeg())
    s3_client.create_bucket(Bucket="inv-flow-reports")
    write_report(s3_client, bucket_rows(s3_client, "inv-flow"), source="inv-flow", dest="inv-flow-reports")
    report_folder = f"s3://inv-flow-reports/{PREFIX}/inv-flow/{CONFIG}/"

    def job(source: str, out: Path, **fields) -> CaptionJob:
        return CaptionJob(source=source, output=str(out), model=str(tiny_llava), shard_size=4,
                          sampling={"max_tokens": 6}, gallery_items=0, **fields)

    listed = vlm_caption(job("s3://inv-flow/", tmp_path / "listed"))
    reported = vlm_caption(job(report_folder, tmp_path / "reported", source_format="inventory"))
    assert listed["fingerprint"] == reported["fingerprint"]  # the bucket's results, not the report's
    assert reported["processed"] == listed["processed"] == 6 and reported["failed"] == 1

    def seen(out: Path) -> list[tuple]:
        return sorted((r["key"], r["question"], r["text"], r["sha256"], r["size"], r["etag"],
                       (r["error"] or {}).get("kind")) for r in _records(out))

    assert seen(tmp_path / "reported") == seen(tmp_path / "listed")
    # Interchangeable: the report over the listing's output finds every item done.
    again = vlm_caption(job(report_folder, tmp_path / "listed", source_format="inventory"))
    assert again["processed"] == 0 and again["skipped_already_done"] == 6
