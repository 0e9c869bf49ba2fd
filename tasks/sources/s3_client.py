"""How an S3 client is made: from a prefect-aws credentials block when one is named (settings
`VLM_CAPTION_AWS_CREDENTIALS_BLOCK` / `VLM_CAPTION_MINIO_CREDENTIALS_BLOCK`), otherwise from the
standard AWS chain (environment, profile, instance role), with the retries and timeouts of the
settings. The credentials are never logged. `tasks/sources/storage.py` shares one client per
process (`shared_s3_storage`)."""

from __future__ import annotations

import functools

from tasks.settings import get_settings


def make_s3_client():
    """A boto3 S3 client from a Prefect credentials block or the standard AWS chain. The
    credentials it resolves are registered for scrubbing from every log line."""
    client = _make_s3_client()
    # What the client signs with, whatever its source (block, environment, profile, role).
    credentials = getattr(getattr(client, "_request_signer", None), "_credentials", None)
    if credentials is not None:
        from tasks.observability import register_secret

        frozen = credentials.get_frozen_credentials()
        register_secret(frozen.access_key, frozen.secret_key, frozen.token)
    return client


@functools.lru_cache(maxsize=8)
def credentials_block(kind: str, name: str):
    """A prefect-aws credentials block, loaded from the Prefect API once per process: a client is
    made again for other settings (a test's endpoint), and when writes each made one, loading the
    block each time made every write fail while the API was away (a server restart mid-run)."""
    import prefect_aws

    return getattr(prefect_aws, kind).load(name)


def _make_s3_client():
    from botocore.config import Config

    settings = get_settings()
    config = Config(retries={"max_attempts": settings.s3_max_attempts, "mode": "adaptive"},
                    max_pool_connections=64, read_timeout=settings.s3_read_timeout_s,
                    connect_timeout=min(settings.s3_read_timeout_s, 60))
    if settings.minio_credentials_block:
        creds = credentials_block("MinIOCredentials", settings.minio_credentials_block)
        return creds.get_client("s3")
    if settings.aws_credentials_block:
        creds = credentials_block("AwsCredentials", settings.aws_credentials_block)
        if settings.s3_endpoint_url:
            return creds.get_boto3_session().client(
                "s3", endpoint_url=settings.s3_endpoint_url, config=config
            )
        return creds.get_s3_client()  # the block's own client parameters (endpoint_url, config)
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=settings.s3_endpoint_url, config=config)
