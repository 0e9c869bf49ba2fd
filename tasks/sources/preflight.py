"""Check the job's locations before any engine starts: list one page of the source (or find the
manifest) and write then delete a small object in the output. A mistake then costs seconds,
not an engine start, and leaves nothing behind; the message says what to do."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

from tasks.sources.storage import StorageError, open_storage, split_parent

PROBE_PREFIX = ".vlm-caption-probe-"


@contextlib.contextmanager
def storage_errors(uri: str, doing: str) -> Iterator[None]:
    """botocore's and the file system's errors as one StorageError that says what to do."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:  # noqa: BLE001 - translated below, or re-raised
        raise StorageError(_explain(uri, doing, exc)) from exc


def _explain(uri: str, doing: str, exc: Exception) -> str:
    name = type(exc).__name__
    code = getattr(exc, "response", {}).get("Error", {}).get("Code", "") if hasattr(exc, "response") else ""
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
    if isinstance(exc, PermissionError):
        return f"{uri}: permission denied while {doing} ({exc})"
    if isinstance(exc, (NotADirectoryError, FileExistsError, FileNotFoundError)):
        return f"{uri}: not a usable folder while {doing} ({exc})"
    return f"{uri}: failed while {doing}: {name}: {exc}"


def check_source(uri: str, *, is_manifest: bool) -> None:
    if is_manifest:
        folder, name = split_parent(uri)
        with storage_errors(uri, "looking for the manifest"):
            if not open_storage(folder).exists(name):
                raise StorageError(f"{uri}: manifest not found")
        return
    with storage_errors(uri, "listing the source"):
        storage = open_storage(uri)
        next(iter(storage.iter_objects()), None)  # one page is enough to prove access


def check_output(uri: str) -> None:
    probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    with storage_errors(uri, "writing a probe object to the output"):
        out = open_storage(uri, create=True)
        out.write(probe, b"vlm-caption output probe; safe to delete\n")
        out.delete(probe)
