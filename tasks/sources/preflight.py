"""Check the job's locations before any engine starts: the source through its reader's `check`,
the output by a probe object written then deleted, and for a fan-out that its partitions see a
local source or output. A mistake costs seconds, leaves nothing behind, and says what to do."""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.s3_client import error_code, is_transient
from vlm_caption.tasks.sources.storage import LocalStorage, Storage, StorageError, open_storage

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


def resolve_source(job, partitions_on: str | None = None) -> tuple[Any, SourceSpec]:
    """The job (a CaptionJob) with `auto` resolved and what its reader's check settled (a Parquet
    column, an inventory's newest report) written back, so every partition reads it the same way,
    and the source's spec, its storage opened. `partitions_on`: see `check_shared_folder`."""
    from vlm_caption.tasks.sources.registry import detect_format, reader_class
    from vlm_caption.tasks.sources.watermark import resolve_modified_since

    with storage_errors(job.location, "listing the source to tell its format"):
        fmt = detect_format(job.location, job.source_format, job.manifest is not None)
    reader = reader_class(fmt)
    with storage_errors(job.location, reader.checking):
        spec = reader.spec_for(job.location, modality=job.modality, glob=job.glob, column=job.column)
        spec = reader(dataclasses.replace(spec, follow_links=job.follow_links)).check()
        spec.storage  # noqa: B018 - opened here, once, and handed down with the spec
    update = {"source_format": "files" if reader.name == "manifest" else fmt, "column": spec.column,
              "modified_since": resolve_modified_since(job.modified_since)}  # a duration: one time for all
    if job.manifest is None:
        update["source"] = spec.where  # an inventory's report named once (the newest under a folder)
    if partitions_on is not None and _is_local(spec.where):  # a folder, or a manifest, tar or Parquet file
        check_shared_folder(spec.where, partitions_on, "source")
    return job.model_copy(update=update), spec


def check_output(uri: str, partitions_on: str | None = None) -> Storage:
    """The output's storage, once a probe object was written there and deleted; folders made for
    it are removed again, so a run refused for another problem leaves nothing behind."""
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
    if partitions_on is not None and isinstance(out, LocalStorage):
        check_shared_folder(uri, partitions_on, "output")
    return out


# A process worker runs each flow run on its own host, which may share a folder with the parent's
# (one host, or a network file system); any other pool type runs each in a container of its own.
HOST_POOL_TYPES = {"process"}
# What a fan-out's partitions do with a local folder, by what it is for, and where to do it instead.
SHARED_USES = {"output": ("shared", "write to s3://"), "source": ("read", "read from s3://")}


def check_shared_folder(uri: str, deployment: str, what: str) -> None:
    """A local source or output folder serves only the fan-out partitions that see it: one whose
    partitions (`deployment`'s) run on a pool of containers is refused before anything starts
    (docs/operations.md, "Fan-out over several GPUs")."""
    pool = partition_pool(deployment)
    if pool is not None and pool[1] not in HOST_POOL_TYPES:
        done, instead = SHARED_USES[what]
        raise StorageError(
            f"{uri}: a local {what} folder cannot be {done} by a fan-out's partitions, which {deployment!r} runs "
            f"in containers of their own (work pool {pool[0]!r}, type {pool[1]}): {instead}, or set fan_out=1")


def partition_pool(deployment: str) -> tuple[str, str] | None:
    """The name and type of the work pool that runs `deployment`; None without PREFECT_API_URL (no
    worker elsewhere reaches an embedded server) or where the deployment or API is not there."""
    from vlm_caption.tasks.prefect_api import import_prefect

    import_prefect()  # as the CLI imports it: a first-run notice is held for the run's terminal
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return None
    try:
        with get_client(sync_client=True) as client:
            pool = client.read_deployment_by_name(deployment).work_pool_name
            return (pool, client.read_work_pool(pool).type) if pool else None
    except (ObjectNotFound, httpx.HTTPError):
        return None


def _folders_to_make(uri: str) -> list[Path]:
    """A local output's folders that do not exist yet, deepest first (none for S3)."""
    if not _is_local(uri):
        return []
    path = Path(uri.removeprefix("file://")).expanduser().absolute()
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")
