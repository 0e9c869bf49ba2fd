"""`vlm-caption bench --history N --history-source inventory`: the history listed by an S3
Inventory report instead of a folder (a folder of 10M files takes longer to walk than the night
has; AWS's advice for buckets past millions of objects is the daily report).

The items live in the loopback moto bucket `bench` under `src/` (the run fetches a report's items
from its source bucket). Only the night's new items are uploaded: a done item's bytes are never
read, so the N done ones exist only as rows of the report. The report is laid out as AWS writes
it (`inventory/bench/nightly/data/*.csv.gz`, gzip CSV without a header, keys form-URL-encoded;
`inventory/bench/nightly/<YYYY-MM-DDTHH-MMZ>/manifest.json`) beside the output, in its folder
(`--source folder`) or in the loopback bucket (`--source s3`). The job names the configuration's
folder, as a nightly deployment does: the night with new items adds the next day's report (the
history's data files and one more with the new keys), which the run then picks as the newest.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

BUCKET = "bench"  # the loopback server's bucket (bench/harness.py's loopback_s3)
ITEMS = "src/"  # where the items are in it
CONFIG = f"{BUCKET}/nightly/"  # <source bucket>/<configuration id>/, as AWS names a report's folders
SCHEMA = "Bucket, Key, Size, LastModifiedDate, ETag, StorageClass"
ROWS_PER_FILE = 1_000_000  # AWS splits a report into files of its own choosing; these are a size it uses
HISTORY_DAY, NIGHT_DAY = "2026-01-01T00-00Z", "2026-01-02T00-00Z"
MODIFIED = "2026-01-01T00:00:00.000Z"


class InventoryLocations:
    """The bench's report, items and outputs when the history is an inventory report."""

    source_format = "inventory"
    key_prefix = ITEMS  # the items' keys in the bucket, which their records name

    def __init__(self, base: Path, source: str):
        self.base = base
        if source == "s3":
            root = f"s3://{BUCKET}/history/"
            self.out, self.new_out = root + "out/", root + "new-out/"
        else:
            root = str(base) + "/"
            self.out, self.new_out = str(base / "out"), str(base / "new-out")
        self.reports = root + "inventory/"  # the history's report and the night's, one configuration
        self.new_reports = root + "inventory-new/"  # the new items alone: a report of their own
        self.source, self.new_source = self.reports + CONFIG, self.new_reports + CONFIG

    def write_history(self, keys: list[str], photo: bytes) -> dict[str, str]:
        """The history's report (its data files and its manifest); returns each folder's etag
        (S3's for a one-part upload, the same for every item: one body)."""
        etag = hashlib.md5(photo).hexdigest()
        files = []
        for start in range(0, len(keys), ROWS_PER_FILE):
            rows = [(key, len(photo), etag) for key in keys[start:start + ROWS_PER_FILE]]
            files.append(write_data_file(self.reports, f"{start // ROWS_PER_FILE:05d}", rows))
        write_manifest(self.reports, HISTORY_DAY, files)
        return {key.split("/", 1)[0]: etag for key in keys}

    def add_new_items(self, keys: list[str], photo: bytes) -> None:
        """The night's new items, each its own bytes (a copy of an earlier item would take its
        answer and make no engine request): uploaded to the bucket, listed in the next day's report
        (after the history's files) and in a report of their own."""
        from concurrent.futures import ThreadPoolExecutor

        from vlm_caption.tasks.sources.storage import open_storage

        items = open_storage(f"s3://{BUCKET}/", create=True)
        bodies = [distinct_jpeg(j) for j in range(len(keys))]
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(items.write, keys, bodies))
        rows = [(key, len(body), hashlib.md5(body).hexdigest()) for key, body in zip(keys, bodies)]
        history = json.loads(_storage(self.reports).read(f"{CONFIG}{HISTORY_DAY}/manifest.json"))["files"]
        write_manifest(self.reports, NIGHT_DAY, [*history, write_data_file(self.reports, "new", rows)])
        write_manifest(self.new_reports, NIGHT_DAY, [write_data_file(self.new_reports, "new", rows)])


def distinct_jpeg(j: int) -> bytes:
    """A small JPEG whose pixels (so bytes) differ with `j`."""
    import io

    from PIL import Image

    image = Image.new("RGB", (96, 64), (90, 140, 200))
    image.putpixel((j % 96, (j // 96) % 64), (j % 256, (j // 256) % 256, (j // 65536) % 256))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=80)
    return buffer.getvalue()


def _storage(uri: str):
    from vlm_caption.tasks.sources.storage import open_storage

    return open_storage(uri, create=True)


def write_data_file(reports: str, name: str, rows: list[tuple[str, int, str]]) -> dict:
    """One gzip CSV data file of the report of these (key, size, etag) (as the manifest lists it)."""
    text = "".join(f'"{BUCKET}","{key.replace("/", "%2F")}","{size}","{MODIFIED}","{etag}","STANDARD"\n'
                   for key, size, etag in rows)
    body = gzip.compress(text.encode(), compresslevel=1)
    key = f"{CONFIG}data/{name}.csv.gz"
    _storage(reports).write(key, body)
    return {"key": key, "size": len(body), "MD5checksum": hashlib.md5(body).hexdigest()}


def write_manifest(reports: str, day: str, files: list[dict]) -> None:
    manifest = {"sourceBucket": BUCKET, "destinationBucket": f"arn:aws:s3:::{BUCKET}", "version": "2016-11-30",
                "creationTimestamp": "1767225600000", "fileFormat": "CSV", "fileSchema": SCHEMA, "files": files}
    _storage(reports).write(f"{CONFIG}{day}/manifest.json", json.dumps(manifest).encode())


def kept_history(base: Path, wanted: dict) -> bool:
    """Whether `base` holds a history synthesized with these settings (`--history-keep`): then
    what the last bench's runs added to its output is removed and the history is used as it is."""
    path = base / "synthesized.json"
    marker = json.loads(path.read_text()) if path.exists() else {}
    if {key: marker.get(key) for key in wanted} != wanted:
        return False
    restore(base / "out", marker)
    for later in ("inventory/" + CONFIG + NIGHT_DAY, "inventory/" + CONFIG + "data/new.csv.gz", "inventory-new",
                  "new-out", "prefect-1", "prefect-2", "prefect-3", "new", "src-new"):
        _remove(base / later)
    return True


def restore(out: Path, marker: dict) -> None:
    """The output as the synthesis left it: every file a later run wrote goes (its parts, manifests,
    gallery, claims; Parquet view files other than the synthesized)."""
    import os

    for folder, _, files in os.walk(out):
        for name in files:
            if name == marker["compacted"] or name == f"{marker['run']}.json":
                continue
            os.remove(os.path.join(folder, name))


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
