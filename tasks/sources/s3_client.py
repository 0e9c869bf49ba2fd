"""The S3 client of a process, made one way whatever gives the credentials (docs/operations.md,
"Credentials"), and the one rule for which storage failures may pass when tried again (retried, or
recorded retryable); anything else a rerun would only repeat. The client retries each call first."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from vlm_caption.tasks.settings import get_settings

POOL_CONNECTIONS = 64  # the fetch threads (tasks/prepare.py: FETCH_CONCURRENCY) and the done-index's readers
RETRY_MODE = "adaptive"  # backs off on throttling for every thread sharing the client


def settings_config():
    """The botocore `Config` our settings give (a pool over botocore's 10: fetch threads would wait)."""
    from botocore.config import Config

    settings = get_settings()
    # botocore's `retries["max_attempts"]` counts the retries after the first request; the
    # setting counts attempts, as `total_max_attempts` does.
    return Config(retries={"total_max_attempts": settings.s3_max_attempts, "mode": RETRY_MODE},
                  max_pool_connections=POOL_CONNECTIONS,
                  read_timeout=settings.s3_read_timeout_s, connect_timeout=min(settings.s3_read_timeout_s, 60))


def merged_config(ours, block_config):
    """`ours` with a block's `Config` merged over it: what the block sets wins. Its `retries`
    merge key by key (a block setting only `max_attempts` keeps the adaptive mode); botocore's
    `max_attempts` (retries after the first request) becomes `total_max_attempts`."""
    if block_config is None:
        return ours
    from botocore.config import Config

    block_retries = dict(block_config.retries or {})
    if "max_attempts" in block_retries and "total_max_attempts" not in block_retries:
        block_retries["total_max_attempts"] = block_retries.pop("max_attempts") + 1
    return ours.merge(block_config).merge(Config(retries={**(ours.retries or {}), **block_retries}))


@functools.lru_cache(maxsize=8)
def credentials_block(kind: str, name: str):
    """A prefect-aws credentials block, loaded once per process: loaded at each client made, every
    write failed while the Prefect API was away (a server restart mid-run)."""
    import prefect_aws

    return getattr(prefect_aws, kind).load(name)


def named_block() -> tuple[str, str] | None:
    """(kind, name) of the credentials block the settings name, or None for the AWS chain."""
    settings = get_settings()
    if settings.minio_credentials_block:
        return "MinIOCredentials", settings.minio_credentials_block
    if settings.aws_credentials_block:
        return "AwsCredentials", settings.aws_credentials_block
    return None


def make_s3_client():
    """A boto3 S3 client from the settings' credentials block (its client parameters, its `Config`
    merged over ours) or the AWS chain; its credentials scrubbed from every log line."""
    import boto3

    if (named := named_block()) is None:
        session, parameters = boto3.session.Session(), {}
    else:
        block = credentials_block(*named)
        session, parameters = block.get_boto3_session(), block.aws_client_parameters.get_params_override()
    parameters["config"] = merged_config(settings_config(), parameters.get("config"))
    if get_settings().s3_endpoint_url:
        parameters["endpoint_url"] = get_settings().s3_endpoint_url
    credentials = session.get_credentials()  # resolved once; the client signs with the same
    if credentials is not None:
        from vlm_caption.tasks.observability import register_secret

        frozen = credentials.get_frozen_credentials()
        register_secret(frozen.access_key, frozen.secret_key, frozen.token)
    return session.client("s3", **parameters)


def describe_client(client) -> dict[str, Any]:
    """What a client does when a call fails or many threads share it (from its public `meta`)."""
    config, named = client.meta.config, named_block()
    return {"credentials": f"{named[0]} block {named[1]!r}" if named else "AWS chain",
            "endpoint_url": client.meta.endpoint_url, "retry_mode": config.retries.get("mode"),
            "max_attempts": config.retries.get("total_max_attempts"),
            "max_pool_connections": config.max_pool_connections,
            "read_timeout_s": config.read_timeout, "connect_timeout_s": config.connect_timeout}


_shared_lock = threading.Lock()
_shared_clients: dict[tuple, object] = {}


def _client_key() -> tuple:
    """What a client is made from: the settings it reads and the AWS chain's environment."""
    settings = get_settings()
    return (settings.s3_endpoint_url, settings.aws_credentials_block, settings.minio_credentials_block,
            settings.s3_max_attempts, settings.s3_read_timeout_s,
            tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))


def shared_s3_client():
    """One client per process for the current settings: its pool and the adaptive mode's rate
    limiting (what it learnt of throttling) serve every read and write."""
    key = _client_key()
    with _shared_lock:
        client = _shared_clients.get(key)
        if client is None:
            client = _shared_clients[key] = make_s3_client()
        return client


def describe_shared_client() -> dict[str, Any] | None:
    """The shared client's `describe_client`, or None where this process made none (folders only)."""
    client = _shared_clients.get(_client_key())
    return describe_client(client) if client is not None else None


class ShortBodyError(OSError):
    """An object arrived shorter than the store said it is (retried; never decoded)."""


def error_code(exc: BaseException) -> str:
    """The store's error code of a botocore `ClientError` (`NoSuchKey`, `SlowDown`), else ''."""
    return (getattr(exc, "response", None) or {}).get("Error", {}).get("Code", "")


T = TypeVar("T")

# What S3-compatible stores answer while overloaded or briefly failing (besides any 5xx and 429).
TRANSIENT_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                             "ServiceUnavailable", "TooManyRequestsException", "RequestLimitExceeded"})
ATTEMPTS = 3
PAUSE_S = 1.0  # before the second attempt; twice that before the third


def is_transient(exc: BaseException) -> bool:
    """Whether the failure of a storage call may pass when the call is made again."""
    from botocore.exceptions import ClientError, ConnectionError as BotoConnectionError, HTTPClientError

    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or status == 429 or error_code(exc) in TRANSIENT_CODES
    # botocore's timeouts and cut connections (HTTPClientError, ConnectionError), and the builtins
    # a local or HTTP read raises for the same.
    return isinstance(exc, (ShortBodyError, BotoConnectionError, HTTPClientError, ConnectionError, TimeoutError))


def retry_transient(call: Callable[[], T], what: str) -> T:
    """`call()`, made again while it fails transiently past the client's own retries (a page or a
    footer is cheap to ask again; a run stopped for it is not), each failure logged as `what`."""
    from vlm_caption.tasks.observability import get_logger

    for attempt in range(1, ATTEMPTS):
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            get_logger().warning("storage read failed; trying again", read=what, attempt=attempt,
                                 error=f"{type(exc).__name__}: {exc}")
            time.sleep(PAUSE_S * attempt)
    return call()  # the last attempt: its failure is raised
