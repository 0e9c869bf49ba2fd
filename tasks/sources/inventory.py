"""An S3 Inventory report as a source: a bucket's objects read from its daily report, fetched from
the source bucket, which the run's fingerprint names (docs/sources.md, "S3 Inventory reports")."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import gzip
import hashlib
import io
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import unquote

from vlm_caption.tasks.sources.formats import SourceSpec, source_storage
from vlm_caption.tasks.sources.items import ObjectRef
from vlm_caption.tasks.sources.reader import FilesReader
from vlm_caption.tasks.sources.storage import Storage, StorageError, matches_glob, open_seekable, split_parent

MANIFEST = "manifest.json"
REPORT_FOLDER = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}-\d{2}Z")  # when S3 began scanning for that report
FORMATS = ("CSV", "Parquet")
# A field of the report: its name in a CSV report's fileSchema, and its column in a Parquet report.
FIELDS = {"key": ("Key", "key"), "size": ("Size", "size"), "etag": ("ETag", "e_tag"),
          "last_modified": ("LastModifiedDate", "last_modified_date"), "is_latest": ("IsLatest", "is_latest"),
          "is_delete_marker": ("IsDeleteMarker", "is_delete_marker")}
# Size and ETag are what a rerun skips a done object by, from the report alone (no fetch).
NEEDED = ("key", "size", "etag")
PARQUET_BATCH = 4096
_PARQUET_NAME = re.compile(r"\b(?:binary|boolean|int32|int64|int96|float|double)\s+(\w+)")
_EPOCH_UNITS = {"s": 1, "ms": 1e3, "us": 1e6, "ns": 1e9}


@dataclass(frozen=True)
class DataFile:
    key: str  # in the destination bucket
    size: int
    md5: str  # of the file's bytes ("" when the manifest gives none)


@dataclass(frozen=True)
class InventoryReport:
    bucket_uri: str  # s3://<sourceBucket>/: where the listed objects are
    file_format: str  # CSV or Parquet
    fields: tuple[str, ...]  # the report's columns, named as its format names them
    files: tuple[DataFile, ...]
    created_at: float  # epoch seconds: when S3 began scanning the bucket for this report
    data_root: str  # the location the files' keys are under


def find_report(uri: str) -> str:
    """The manifest.json a location names: itself, the one in that folder, or the newest
    `<YYYY-MM-DDTHH-MMZ>/manifest.json` under it."""
    if uri.rstrip("/").endswith(MANIFEST):
        return uri.rstrip("/")
    storage = source_storage(uri)
    if storage.exists(MANIFEST):
        return storage.describe(MANIFEST)
    dated = [ref.key for ref in storage.iter_objects(MANIFEST)
             if ref.key.count("/") == 1 and REPORT_FOLDER.fullmatch(ref.key.split("/")[0])]
    if not dated:
        raise StorageError(f"{uri}: no S3 Inventory report there (no manifest.json, nor a "
                           "<YYYY-MM-DDTHH-MMZ>/manifest.json under it); give the report's manifest.json "
                           "or its configuration's folder")
    return storage.describe(max(dated))


def report_series(manifest_uri: str) -> str:
    """The folder every day's report of a configuration shares (the dated folder's parent)."""
    folder = split_parent(manifest_uri)[0]
    parent, name = split_parent(folder)
    return parent if REPORT_FOLDER.fullmatch(name) else folder


def read_report(manifest_uri: str) -> InventoryReport:
    folder, name = split_parent(manifest_uri)
    try:
        doc = json.loads(source_storage(folder).read(name))
    except FileNotFoundError as exc:
        raise StorageError(f"{manifest_uri}: no such inventory manifest") from exc
    except ValueError as exc:
        raise StorageError(f"{manifest_uri}: not an S3 Inventory manifest (not JSON: {exc})") from exc
    missing = [k for k in ("sourceBucket", "fileFormat", "fileSchema", "files") if k not in doc]
    if missing:
        raise StorageError(f"{manifest_uri}: not an S3 Inventory manifest (no {', '.join(missing)})")
    fmt = next((f for f in FORMATS if f.lower() == str(doc["fileFormat"]).lower()), None)
    if fmt is None:
        raise StorageError(f"{manifest_uri}: a {doc['fileFormat']} report; vlm-caption reads CSV and Parquet "
                           "inventory reports: set the inventory configuration's output format to CSV or "
                           "Apache Parquet")
    schema = str(doc["fileSchema"])
    fields = tuple(_PARQUET_NAME.findall(schema)) if fmt == "Parquet" else tuple(s.strip() for s in schema.split(","))
    files = tuple(DataFile(f["key"], int(f.get("size", -1)), f.get("MD5checksum", "")) for f in doc["files"])
    lacking = [FIELDS[f][0] for f in NEEDED if FIELDS[f][fmt == "Parquet"] not in fields]
    if lacking:
        raise StorageError(f"{manifest_uri}: the report has no {', '.join(lacking)} field; add Size and ETag to "
                           "the inventory configuration's additional fields (a rerun skips done objects by them)")
    return InventoryReport(f"s3://{doc['sourceBucket']}/", fmt, fields, files,
                           int(doc.get("creationTimestamp", 0)) / 1000,
                           _data_root(folder, files, str(doc.get("destinationBucket", ""))))


def _data_root(folder: str, files: tuple[DataFile, ...], destination: str) -> str:
    """Where the files' keys (`<prefix>/<source bucket>/<config-id>/data/...`) start: the manifest's
    folders matched against a key's, so a copy of the report (another bucket, a folder) works too."""
    scheme, sep, rest = folder.partition("://")
    if sep:
        bucket, _, path = rest.partition("/")
        head = f"{scheme}://{bucket}/"
    else:
        head, path = ("/" if folder.startswith("/") else ""), folder
    folders = [p for p in path.split("/") if p]
    key_folders = files[0].key.split("/")[:-1] if files else []
    shared = [len(os.path.commonprefix([folders[start:], key_folders])) for start in range(len(folders))]
    if any(shared):  # the first start that shares the most folders
        return head + "".join(f"{p}/" for p in folders[:shared.index(max(shared))])
    bucket = destination.rpartition(":")[2]
    return f"s3://{bucket}/" if bucket else folder


Row = tuple[str, int, str, float | None, bool | None, bool]  # key, size, etag, modified, latest, deleted


def csv_rows(storage: Storage, file: DataFile, report: InventoryReport) -> Iterator[Row]:
    """A gzip CSV data file's rows (columns: the manifest's fileSchema), its MD5 checked at the end."""
    where = {name: i for i, name in enumerate(report.fields)}
    key, size, etag, modified, latest, deleted = (where.get(FIELDS[f][0]) for f in FIELDS)
    with open_seekable(storage, file.key, file.size) as raw:
        checked = _Checked(raw)
        text = io.TextIOWrapper(gzip.GzipFile(fileobj=checked), encoding="utf-8", newline="")
        for line, row in enumerate(csv.reader(text), start=1):
            if not row:
                continue
            try:
                parsed = (_decode_key(row[key]), int(row[size]) if row[size] else -1, row[etag],
                          iso_seconds(row[modified]) if modified is not None and row[modified] else None,
                          row[latest].lower() == "true" if latest is not None else None,
                          deleted is not None and row[deleted].lower() == "true")
            except (IndexError, ValueError) as exc:  # the same row again would fail the same way
                raise StorageError(f"{storage.describe(file.key)} line {line}: not a row of the manifest's "
                                   f"fileSchema ({', '.join(report.fields)}): {exc}") from None
            yield parsed
        checked.verify(file, storage)


def parquet_rows(storage: Storage, file: DataFile) -> Iterator[Row]:
    import pyarrow.parquet as pq

    with open_seekable(storage, file.key, file.size) as handle:
        parquet = pq.ParquetFile(handle)
        names = set(parquet.schema_arrow.names)
        columns = {f: FIELDS[f][1] for f in FIELDS if FIELDS[f][1] in names}
        lacking = [FIELDS[f][1] for f in NEEDED if f not in columns]
        if lacking:
            raise StorageError(f"{storage.describe(file.key)}: no {', '.join(lacking)} column in this inventory file")
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH, columns=list(columns.values())):
            values = {f: batch.column(name) for f, name in columns.items()}
            n = batch.num_rows
            modified = _epoch_seconds(values["last_modified"]) if "last_modified" in values else [None] * n
            latest = values["is_latest"].to_pylist() if "is_latest" in values else [None] * n
            deleted = values["is_delete_marker"].to_pylist() if "is_delete_marker" in values else [False] * n
            yield from zip(values["key"].to_pylist(), (-1 if s is None else s for s in values["size"].to_pylist()),
                           (e or "" for e in values["etag"].to_pylist()), modified, latest, (bool(d) for d in deleted))


def _decode_key(text: str) -> str:
    """A CSV report's key, form-URL-decoded (`+` a space, `%2B` a plus). The folders' `%2F` first,
    by hand: urllib's decoder is half the listing's time, and most keys need nothing more."""
    if "+" in text:
        text = text.replace("+", " ")
    if "%" in text:
        text = text.replace("%2F", "/")
        if "%" in text:
            text = unquote(text)
    return text


def iso_seconds(text: str) -> float:
    """`2016-11-06T21:32:00.000Z` (a CSV report's LastModifiedDate, a --modified-since) as epoch seconds."""
    moment = datetime.datetime.fromisoformat(text.strip())
    return (moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)).timestamp()


def _epoch_seconds(array) -> list[float | None]:
    import pyarrow as pa

    if pa.types.is_timestamp(array.type):
        scale = _EPOCH_UNITS[array.type.unit]
        return [None if v is None else v / scale for v in array.cast(pa.int64()).to_pylist()]
    if pa.types.is_integer(array.type):  # the raw int64 of a TIMESTAMP_MILLIS column
        return [None if v is None else v / 1e3 for v in array.to_pylist()]
    return [None if v is None else iso_seconds(v) for v in array.to_pylist()]


class _Checked:
    """A data file's bytes as gzip reads them, hashed: one cut short or replaced fails the run."""

    def __init__(self, raw):
        self.raw, self.md5 = raw, hashlib.md5(usedforsecurity=False)

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.md5.update(data)
        return data

    def verify(self, file: DataFile, storage: Storage) -> None:
        while self.read(1 << 20):  # whatever gzip left unread
            pass
        if file.md5 and self.md5.hexdigest() != file.md5.lower():
            raise StorageError(f"{storage.describe(file.key)}: its MD5 is {self.md5.hexdigest()}, the inventory "
                               f"manifest says {file.md5}; the report is damaged or was replaced: run again once "
                               "it is whole")


class InventoryReader(FilesReader):
    """A listing of the bucket in all but where the names come from (so also groups, --modified-since)."""

    name = "inventory"
    about = ("an S3 Inventory report: its manifest.json, or a folder of dated reports, the newest (the items "
             "are its bucket's objects)")
    suffixes = (MANIFEST,)
    checking = "reading the inventory report"

    @classmethod
    def spec_for(cls, location: str, *, modality: str = "image", glob: str | None = None,
                 column: str | None = None) -> SourceSpec:
        """Listed from the report, fetched from its source bucket (for a folder of reports, once `check` ran)."""
        bucket = read_report(location).bucket_uri if location.rstrip("/").endswith(MANIFEST) else None
        return SourceSpec(location, modality, glob=glob, format=cls.name, items_root=bucket)

    @classmethod
    def results_location(cls, location: str, spec: SourceSpec | None) -> str:
        """The source bucket: results are shared with a listing of it and with every day's report."""
        return (spec or cls.spec_for(location)).base

    def check(self) -> SourceSpec:
        """The report the location names, readable, its first data file there; the spec names its manifest."""
        manifest = find_report(self.spec.uri)
        report = read_report(manifest)
        if report.files and not source_storage(report.data_root).exists(report.files[0].key):
            raise StorageError(f"{manifest}: its data file {report.files[0].key} is not under {report.data_root}; "
                               "a copy of a report keeps its data/ folder beside its dated folders")
        return dataclasses.replace(self.spec, uri=manifest, items_root=report.bucket_uri, opened=None)

    def objects(self) -> Iterator[ObjectRef]:
        """The objects the report lists, as a listing gives them (no folder markers, the glob applied)."""
        report = read_report(self.spec.uri)
        storage = source_storage(report.data_root)
        for file in report.files:
            rows = csv_rows(storage, file, report) if report.file_format == "CSV" else parquet_rows(storage, file)
            for key, size, etag, modified, latest, deleted in rows:
                if deleted or latest is False or not key or key.endswith("/") or not matches_glob(key, self.spec.glob):
                    continue
                yield ObjectRef(key, size, etag.strip('"'), modified)
