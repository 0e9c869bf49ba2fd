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
    s3_read_timeout_s: float = 60.0  # a stalled connection is dropped and retried after this
    s3_max_attempts: int = 8  # boto3's retries (throttling, 5xx, resets), adaptive mode
    # Bytes of fetched-but-not-yet-decoded media held at once by this process, over every shard
    # being prepared (videos are large: the bound is on bytes, not on a count of objects).
    max_bytes_in_flight: int = 1024**3
    max_object_bytes: int = 2 * 1024**3  # one object (a video) over this is an error record
    # Engine feed: shards whose requests are in the engine at once. More keeps a large GPU's
    # batch full between shards; each holds its decoded media in memory. None: sized by
    # `tasks.engine.feed.feed_depth` (images: at least 6 shards and twice the engine's batch, at
    # most 2,048 requests and `feed_media_bytes` of decoded media; videos and groups: 2 shards).
    feed_depth: int | None = None
    feed_media_bytes: int = 2 * 1024**3  # decoded images held by the shards in the engine
    # Shards fetched and decoded at once ahead of the engine once it is running (while it starts,
    # as many as its feed will hold). One shard at a time is a shard's latency (its task run, its
    # fetches) per shard, which a small model outruns.
    prepare_ahead: int = 2
    # vLLM's request rendering (the model's HF processor) in this many processes beside the
    # engine; 0: in the engine's process, as vLLM does. Turns vLLM's multimodal processor cache
    # off (see tasks/engine/render.py). Off by default: on an H100 with the tiny LLaVA at
    # 1920x1080 (images already shrunk by the decode pool), 512 images went 66 img/s with 4
    # render processes and 90 img/s without, because starting the workers competes with a short
    # run; at 1024 images the pool gave 1.09x raw. Try it for long runs of heavy processors.
    render_processes: int = 0
    # Media
    decode_processes: int | None = None  # image decode pool; None: one per usable core, 0: no pool
    # How much lower the decode workers' CPU priority is than the flow's (Unix `nice`): with one
    # worker per core they would otherwise take cores from vLLM's engine-core scheduler and from
    # the feed, and the GPU waits on a busy CPU (H100, tiny LLaVA, 512 photos at 1920x1080:
    # 79.75 img/s at nice 10, 58.45 at 0, same run). 0: the same priority.
    decode_niceness: int = 10
    max_image_pixels: int = 64_000_000  # refuse decompression bombs beyond this
    max_video_seconds: float = 3 * 3600.0
    max_video_frame_pixels: int = 3840 * 2160
    # A second run of the same job waits this long for the first, then fails with a clear message.
    job_wait_s: float = 6 * 3600.0
    # Logging on stderr (a worker's log collector reads it): "json", "console", or "auto" (console
    # on a terminal, JSON otherwise). The lines in the Prefect UI read `event key=value` whatever this is.
    log_format: str = "auto"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
