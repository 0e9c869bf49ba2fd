"""Process-wide settings from the environment (`VLM_CAPTION_*`), with sane defaults."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VLM_CAPTION_", extra="ignore")

    # Storage
    s3_endpoint_url: str | None = Field(
        None, description="Endpoint of an S3-compatible store (MinIO, R2, Ceph); boto3's own `AWS_ENDPOINT_URL` "
        "works too. Unset: AWS S3.")
    aws_credentials_block: str | None = Field(
        None, description="Name of a prefect-aws `AwsCredentials` block to take S3 credentials from. Unset: the "
        "standard AWS chain (environment, profile, instance role).")
    minio_credentials_block: str | None = Field(
        None, description="Name of a prefect-aws `MinIOCredentials` block to take S3 credentials from, instead "
        "of an `AwsCredentials` block.")
    s3_read_timeout_s: float = Field(
        60.0, description="Seconds after which a stalled S3 read is dropped and retried.")
    s3_max_attempts: int = Field(
        8, description="Attempts per S3 call, boto3's adaptive retries (throttling, 5xx, connection resets).")
    max_object_bytes: int = Field(
        2 * 1024**3, description="Largest object fetched; a bigger one (a video) is an error record.")
    # Engine feed: more shards in the engine keep a large GPU's batch full between shards; each
    # holds its decoded media in memory.
    feed_depth: int | None = Field(
        None, description="Shards whose requests are in the engine at once. Unset: sized by "
        "`tasks.engine.feed.feed_depth` (images and groups: at least 6 shards and twice the engine's batch, at "
        "most 2,048 requests and `VLM_CAPTION_FEED_MEDIA_BYTES` of decoded media; videos: 2 shards).")
    feed_media_bytes: int = Field(
        2 * 1024**3, description="Decoded images the shards in the engine's feed may hold; bounds the feed's "
        "depth for images and groups (never under 2 shards).")
    # One shard ahead at a time is a shard's latency (its task run, its fetches) per shard, which a
    # small model outruns.
    prepare_ahead: int = Field(
        2, description="Shards fetched and decoded ahead of the engine, and all that are prepared while it builds "
        "(once it runs, its feed fills to `VLM_CAPTION_FEED_DEPTH`).")
    # Media
    decode_processes: int | None = Field(
        None, description="Processes of the decode pool. Unset: one per core this process may use (cpuset, "
        "taskset), at most 16 for a pool made for videos; 0: decode in the fetch threads.")
    # Videos are decoded one at a time per process (tasks/media/video.py), about as fast as one
    # GPU takes a small video model's clips. In the pool, clips decode in parallel (each pool
    # process imports vLLM's loader while the engine starts, and hands the frames back through
    # shared memory: tasks/media/shared_frames.py), which keeps a GPU host's GPUs fed. On a small
    # CPU host it costs: OpenCV already spreads one decode over the cores, and the CPU engine
    # needs them. So `auto` pools only where the engine has a GPU (docs/benchmarks.md, "Several
    # GPUs").
    video_decode_in_pool: bool | Literal["auto"] = Field(
        "auto", description="Decode videos in the decode pool's processes, several at once (each pool process "
        "then imports vLLM's video loader); false: one at a time per process, in the fetch threads; auto: in "
        "the pool where this process sees a CUDA GPU.")
    # With one worker per core, the GPU would wait on a busy CPU (docs/benchmarks.md, "Settings compared
    # in one run").
    decode_niceness: int = Field(
        10, description="How much lower the decode workers' CPU priority is than the flow's (Unix `nice`), so "
        "they never take a core from vLLM's scheduler or the feed; 0: the same.")
    # Threads each decode process gives torch (the processor's resize) and OpenCV. Their default
    # is one per core in every process: a pool of one process per core then runs cores x cores
    # threads, and torch's OpenMP threads spin while they wait for work, taking the cores from
    # the other processes (PyTorch's DataLoader workers keep to one thread for the same reason).
    decode_threads: int = Field(
        1, description="Threads each decode-pool process gives torch and OpenCV (the pool is the parallelism); "
        "0: the libraries' own default, one per core.")
    max_image_pixels: int = Field(
        64_000_000, description="Largest image decoded (decompression bombs); a bigger one is an error record.")
    max_video_seconds: float = Field(
        3 * 3600.0, description="Longest video decoded; a longer one is an error record.")
    max_video_frame_pixels: int = Field(
        3840 * 2160, description="Largest video frame (width x height); a bigger video is an error record.")
    # Pictures are a nicety: a store that answers slowly or fails often (boto3 retries each read up
    # to s3_max_attempts times, backing off) must not hold the run's end for longer than its
    # captions took (docs/benchmarks.md, "Figures behind the defaults").
    gallery_fetch_s: float = Field(
        20.0, description="Seconds a run spends fetching its gallery's pictures; an item whose picture is not "
        "there by then shows a placeholder.")
    gallery_link_s: int = Field(
        0, ge=0, le=7 * 24 * 3600, description="For an S3 output, the UI's `vlm-caption-gallery` artifact is a "
        "presigned link to the gallery page, valid this many seconds (at most 604800, S3's limit). The link holds "
        "the access key id (and a session token) of the credentials that signed it. 0: the artifact is the "
        "gallery's items as a table, as for a folder output.")
    job_wait_s: float = Field(
        6 * 3600.0, description="Seconds a second run of the same job waits for the first (one run per job), "
        "then fails with a clear message.")
    gpu_hour_price: float | None = Field(
        None, description="Price of one GPU (or, on a CPU host, one engine) per hour, in your currency: the "
        "summary and the manifest then give the run's cost per 1,000 items from its device-seconds. Unset: no "
        "cost, device-seconds only.")
    # Logging (on stderr, where a worker's log collector reads it)
    log_format: str = Field(
        "auto", description="Log lines on stderr: `json`, `console`, or `auto` (console on a terminal, JSON "
        "otherwise). The Prefect UI shows `event key=value` whatever this is.")
    log_dir: str | None = Field(
        None, description="Where `vlm-caption run` and `demo` write a run's log file (Prefect's, vLLM's and the "
        "flow's lines; the terminal shows a progress bar and a summary). Unset: `logs/` in a folder output, "
        "`./vlm-caption-logs/` for an S3 one.")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()

