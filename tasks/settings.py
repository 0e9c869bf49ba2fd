"""Process-wide settings from the environment (`VLM_CAPTION_*`), with sane defaults."""

from __future__ import annotations

from functools import lru_cache

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VLM_CAPTION_", extra="ignore")

    # Storage
    s3_endpoint_url: str | None = None  # MinIO, R2, Ceph...; AWS_ENDPOINT_URL works too
    aws_credentials_block: str | None = None  # name of a prefect-aws AwsCredentials block
    minio_credentials_block: str | None = None  # name of a prefect-aws MinIOCredentials block
    fetch_concurrency: int = 16
    # Media
    max_image_pixels: int = 64_000_000  # refuse decompression bombs beyond this
    # Logging: "json", "console", or "auto" (console on a terminal, JSON otherwise)
    log_format: str = "auto"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
