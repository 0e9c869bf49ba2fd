"""The S3 client of a process: one way to make it, whatever gives the credentials.

Credentials come from a prefect-aws block when one is named (`VLM_CAPTION_AWS_CREDENTIALS_BLOCK`:
`AwsCredentials`, `VLM_CAPTION_MINIO_CREDENTIALS_BLOCK`: `MinIOCredentials`), otherwise from the
standard AWS chain (environment, profile, instance role). Either way the client is made from a
boto3 session with the same botocore `Config`: adaptive retries (`VLM_CAPTION_S3_MAX_ATTEMPTS`
attempts per call), the read timeout, and a connection pool for every fetch thread and
done-index reader. A block's own client parameters are kept: its endpoint (the
`VLM_CAPTION_S3_ENDPOINT_URL` setting, where set, wins), `verify`, `use_ssl`, and the values its
`config` sets, which take precedence over ours. `describe_shared_client` says what a run's client
did (the manifest's `s3`). The credentials are registered for scrubbing from every log line.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from vlm_caption.tasks.settings import get_settings

POOL_CONNECTIONS = 64  # the fetch threads (tasks/prepare.py: FETCH_CONCURRENCY) and the done-index's readers
RETRY_MODE = "adaptive"  # backs off on throttling for every thread sharing the client


def settings_config():
    """The botocore `Config` our settings give: retries, timeouts, the connection pool. Every
    fetch thread and each of the done-index's readers holds a connection while it reads; with
    fewer, threads wait for one (botocore's default is 10)."""
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
    """A prefect-aws credentials block, loaded from the Prefect API once per process: a client is
    made again for other settings (a test's endpoint), and when writes each made one, loading the
    block each time made every write fail while the API was away (a server restart mid-run)."""
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


def session_and_parameters(block=None) -> tuple[Any, dict[str, Any]]:
    """The boto3 session that holds the credentials and the `client("s3", ...)` arguments: the
    block's client parameters (endpoint, verify, use_ssl, api_version) and the merged `Config`."""
    import boto3

    settings = get_settings()
    if block is None:
        session, parameters = boto3.session.Session(), {}
    else:
        session = block.get_boto3_session()
        parameters = block.aws_client_parameters.get_params_override()
    parameters["config"] = merged_config(settings_config(), parameters.get("config"))
    if settings.s3_endpoint_url:
        parameters["endpoint_url"] = settings.s3_endpoint_url
    return session, parameters


def make_s3_client(block=None):
    """A boto3 S3 client from `block` (a prefect-aws `AwsCredentials` or `MinIOCredentials`), or
    the block the settings name, or the AWS chain. The credentials it signs with are registered
    for scrubbing from every log line."""
    if block is None and (named := named_block()) is not None:
        block = credentials_block(*named)
    session, parameters = session_and_parameters(block)
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
    """What a client is made from: the settings it reads and the AWS chain's environment. Another
    endpoint, block or set of credentials (a test's, a profile switched) gets another client."""
    settings = get_settings()
    return (settings.s3_endpoint_url, settings.aws_credentials_block, settings.minio_credentials_block,
            settings.s3_max_attempts, settings.s3_read_timeout_s,
            tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))


def shared_s3_client():
    """One client per process for the current settings. A boto3 client is thread-safe and meant
    to be shared: its connection pool and the `adaptive` retry mode's client-side rate limiting
    (what it learnt of throttling) then serve every read and write."""
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
