"""An S3 Inventory report as a source: a bucket's objects as S3 lists them daily, read from the
report instead of listing the bucket (what AWS recommends past millions of objects: no List
requests, and the bucket's request rate untouched).

The report is named by its `manifest.json` (`s3://<destination>/<prefix>/<source-bucket>/
<config-id>/<YYYY-MM-DDTHH-MMZ>/manifest.json`, or a local copy), or by a folder above it: then
the manifest in that folder, or else the newest `<date>/manifest.json` under it (a nightly
deployment names the configuration's folder), chosen once at the run's start (pre-flight).

The manifest names the source bucket, the data files' format (CSV or Parquet; ORC is refused)
and schema; each data file (gzip CSV without a header row, keys form-URL-encoded; or Parquet,
columns named in lower case) is streamed, one at a time, never whole. Its rows are the source
bucket's objects as a listing gives them (key, size, etag, last modified), filtered by the job's
glob; delete markers and versions that are not the latest are skipped. The items are fetched
from `s3://<sourceBucket>/` like a listed bucket's, and the run's fingerprint names that bucket,
not the report: results are interchangeable with a listing of the bucket and with every later
report's (the report's own path changes daily).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from vlm_caption.tasks.sources.files import FilesReader
from vlm_caption.tasks.sources.formats import SourceSpec, source_storage
from vlm_caption.tasks.sources.inventory_report import MANIFEST, csv_rows, find_report, parquet_rows, read_report
from vlm_caption.tasks.sources.items import ObjectRef
from vlm_caption.tasks.sources.storage import StorageError, matches_glob


class InventoryReader(FilesReader):
    """A bucket's objects as its S3 Inventory report lists them, fetched from the bucket: a
    listing of it in all but where the names come from (so also groups, and `--modified-since`)."""

    name = "inventory"
    about = ("an S3 Inventory report: its manifest.json, or a folder of dated reports, the newest (the items "
             "are its bucket's objects)")
    suffixes = (MANIFEST,)
    checking = "reading the inventory report"

    @classmethod
    def spec_for(cls, location: str, *, modality: str = "image", glob: str | None = None,
                 column: str | None = None) -> SourceSpec:
        """A report's spec: listed from the report, fetched from its source bucket (for a folder of
        reports, known once `check` found the report)."""
        bucket = read_report(location).bucket_uri if location.rstrip("/").endswith(MANIFEST) else None
        return SourceSpec(location, modality, glob=glob, format=cls.name, items_root=bucket)

    @classmethod
    def results_location(cls, location: str, spec: SourceSpec | None) -> str:
        """The source bucket: results are shared with a listing of it and with every day's report."""
        return (spec or cls.spec_for(location)).base

    def check(self) -> SourceSpec:
        """Pre-flight: the report the location names, readable, its first data file there. The spec
        names its manifest (once: every partition reads that report)."""
        manifest = find_report(self.spec.uri)
        report = read_report(manifest)
        if report.files and not source_storage(report.data_root).exists(report.files[0].key):
            raise StorageError(f"{manifest}: its data file {report.files[0].key} is not under {report.data_root}; "
                               "a copy of a report keeps its data/ folder beside its dated folders")
        return dataclasses.replace(self.spec, uri=manifest, items_root=report.bucket_uri, opened=None)

    def objects(self) -> Iterator[ObjectRef]:
        """The source bucket's objects the report lists, as a listing of it gives them (no folder
        markers; the glob applied), data file after data file."""
        report = read_report(self.spec.uri)
        storage = source_storage(report.data_root)
        for file in report.files:
            rows = csv_rows(storage, file, report) if report.file_format == "CSV" else parquet_rows(storage, file)
            for key, size, etag, modified, latest, deleted in rows:
                if deleted or latest is False or not key or key.endswith("/") or not matches_glob(key, self.spec.glob):
                    continue
                yield ObjectRef(key, size, etag.strip('"'), modified)
