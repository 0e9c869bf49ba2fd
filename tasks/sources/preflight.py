"""Check the job's locations before any engine starts: list one page of the source (or find the
manifest) and write then delete a small object in the output. A mistake then costs seconds,
not an engine start, and leaves nothing behind; the message says what to do."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

from tasks.sources.formats import source_storage
from tasks.sources.storage import Storage, StorageError, error_code, open_storage, split_parent
from tasks.sources.transient import is_transient

PROBE_PREFIX = ".vlm-caption-probe-"


@contextlib.contextmanager
def storage_errors(uri: str, doing: str) -> Iterator[None]:
    """botocore's and the file system's errors as one StorageError that says what to do."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:  # noqa: BLE001 - translated below, or re-raised
        error = StorageError(_explain(uri, doing, exc))
        error.permanent = not is_transient(exc)  # a store that kept failing may answer a retry of the run
        raise error from exc


def _explain(uri: str, doing: str, exc: Exception) -> str:
    name = type(exc).__name__
    code = error_code(exc)
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return (f"{uri}: no S3 credentials while {doing}. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or a profile or instance role), or name a prefect-aws block in "
                "VLM_CAPTION_AWS_CREDENTIALS_BLOCK.")
    if code in ("NoSuchBucket",):
        return f"{uri}: the bucket does not exist ({doing})"
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return f"{uri}: access denied while {doing} ({code}); check the credentials and the bucket policy"
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionError"):
        return f"{uri}: cannot reach the S3 endpoint while {doing} ({exc}); check VLM_CAPTION_S3_ENDPOINT_URL"
    if is_transient(exc):
        return (f"{uri}: the store kept failing while {doing} ({name}: {exc}), past the S3 client's "
                "retries (VLM_CAPTION_S3_MAX_ATTEMPTS); it may pass: run the job again")
    if isinstance(exc, PermissionError):
        return f"{uri}: permission denied while {doing} ({exc})"
    if isinstance(exc, (NotADirectoryError, FileExistsError, FileNotFoundError)):
        return f"{uri}: not a usable folder while {doing} ({exc})"
    return f"{uri}: failed while {doing}: {name}: {exc}"


def check_source(uri: str, *, is_manifest: bool, source_format: str = "files",
                 column: str | None = None) -> str | None:
    """`source_format` is resolved (not `auto`); webdataset and parquet need one shard file, and
    parquet its media column (the message names the columns there are), which is returned; an
    inventory, a readable report, whose manifest.json is returned."""
    if source_format in ("webdataset", "parquet"):
        from tasks.sources.formats import file_set, first_file
        from tasks.sources.parquet_source import check_parquet_source

        with storage_errors(uri, "listing the source"):
            files = file_set(uri, source_format)
            if source_format == "parquet":
                return check_parquet_source(files, column)
            if first_file(files) is None:
                raise StorageError(f"{uri}: no {files.suffix} shard there; give a tar, a folder or prefix of "
                                   "tars, or a brace pattern such as shards/{00000..00099}.tar")
        return None
    if source_format == "inventory":  # the report's manifest.json, returned (tasks/sources/inventory.py)
        from tasks.sources.inventory import check_report

        with storage_errors(uri, "reading the inventory report"):
            return check_report(uri)
    if is_manifest:
        folder, name = split_parent(uri)
        with storage_errors(uri, "looking for the manifest"):
            if not source_storage(folder).exists(name):
                raise StorageError(f"{uri}: manifest not found")
        return None
    with storage_errors(uri, "listing the source"):
        storage = source_storage(uri)
        next(iter(storage.iter_objects()), None)  # one page is enough to prove access
    return None


def resolve_source(job):
    """The job (a CaptionJob) with `source_format: auto` resolved and, for Parquet, its media
    column named, after checking the source: every partition then reads it the same way, and a
    wrong column is one message naming the columns there are."""
    from tasks.sources.formats import detect_format
    from tasks.sources.watermark import resolve_modified_since

    with storage_errors(job.location, "listing the source to tell its format"):
        fmt = detect_format(job.location, job.source_format, job.manifest is not None)
    found = check_source(job.location, is_manifest=job.manifest is not None, source_format=fmt, column=job.column)
    update = {"source_format": fmt, "column": found if fmt == "parquet" else None,
              "modified_since": resolve_modified_since(job.modified_since)}  # a duration: one time for all
    if fmt == "inventory":
        update["source"] = found  # the report named once (the newest under a folder): every partition reads it
    return job.model_copy(update=update)


def check_output(uri: str) -> Storage:
    """The output's storage, once a probe object was written there and deleted. Folders made
    for the probe are removed again (the first write makes them): a run refused for another
    problem leaves nothing behind."""
    probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    made = _folders_to_make(uri)
    with storage_errors(uri, "writing a probe object to the output"):
        try:
            out = open_storage(uri, create=True)
            out.write(probe, b"vlm-caption output probe; safe to delete\n")
            out.delete(probe)
        finally:
            for folder in made:  # deepest first; only ones that are (still) empty
                with contextlib.suppress(OSError):
                    folder.rmdir()
    return out


def _folders_to_make(uri: str) -> list[Path]:
    """A local output's folders that do not exist yet, deepest first (none for S3)."""
    if "://" in uri and not uri.startswith("file://"):
        return []
    path = Path(uri.removeprefix("file://")).expanduser().absolute()
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing
