"""Decode (and shrink) images, and videos where VLM_CAPTION_VIDEO_DECODE_IN_POOL says (by default
where a GPU is seen), in a pool of processes sized to the cores, so decoding runs in parallel,
outside the GIL that vLLM's request processing and Prefect share."""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import sys
import threading
from concurrent.futures import Executor, ProcessPoolExecutor

from vlm_caption.tasks.media.image import decode_image
from vlm_caption.tasks.media.resize import FrameResize, ImageResize
from vlm_caption.tasks.media.shared_frames import share_frames, taken
from vlm_caption.tasks.media.video import DecodedVideo, VideoLimits, decode_video, video_loader
from vlm_caption.tasks.settings import get_settings

_POOL: Executor | None = None
_POOL_SIZE = 0
_LOCK = threading.Lock()


def decode_job(data: bytes, max_pixels: int, target: ImageResize | None):
    """Runs in a pool process (a MediaError comes back whole: `MediaError.__reduce__`)."""
    image = decode_image(data, max_pixels=max_pixels)
    return target.apply(image) if target else image


def decode_video_job(data: bytes, num_frames: int, limits: VideoLimits, resize: FrameResize | None):
    """Runs in a pool process, as `decode_job`. The frames travel in shared memory where there is
    room (tasks/media/shared_frames.py): the pool's one result pipe carried about 30 clips/s
    whatever the processes."""
    video = decode_video(data, num_frames=num_frames, limits=limits, resize=resize)
    video.frames = share_frames(video.frames)
    return video


def _start_worker(niceness: int, videos: bool, threads: int = 0) -> None:
    """Pool initializer: decoding is work ahead of the engine, so it yields the CPU to the
    engine's scheduler and the feed, and keeps to `threads` threads (VLM_CAPTION_DECODE_THREADS;
    0: the libraries' defaults). A video pool's process has vLLM's loader before its first clip."""
    if niceness > 0 and hasattr(os, "nice"):
        os.nice(niceness)
    if threads > 0:
        keep_to_threads(threads)
    if videos:
        video_loader()
        if threads > 0:
            keep_to_threads(threads)  # torch and OpenCV as the loader imported them


def keep_to_threads(threads: int) -> None:
    """Torch's and OpenCV's threads in this process: set on the modules already imported, and in
    the environment each reads as it is first imported."""
    os.environ["OMP_NUM_THREADS"] = os.environ["OPENCV_FOR_THREADS_NUM"] = str(threads)
    if (torch := sys.modules.get("torch")) is not None:
        torch.set_num_threads(threads)
    if (cv2 := sys.modules.get("cv2")) is not None:
        cv2.setNumThreads(threads)


def videos_in_pool() -> bool:
    """Whether this process decodes videos in the pool (VLM_CAPTION_VIDEO_DECODE_IN_POOL; `auto`:
    where it sees a CUDA GPU, whose engine outruns one decode at a time)."""
    setting = get_settings().video_decode_in_pool
    return _sees_a_gpu() if setting == "auto" else bool(setting)


@functools.cache
def _sees_a_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no usable torch: no GPU either
        return False


def decode_processes() -> int:
    configured = get_settings().decode_processes
    return usable_cores() if configured is None else configured


def usable_cores() -> int:
    """The cores this process may run on (a container's cpuset, `taskset`), not the host's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity on this platform (macOS)
        return os.cpu_count() or 1


# A pool made for videos holds vLLM's loader (torch) in each process: one per core of a big host
# would hold tens of GB. Sixteen decode more clips than a GPU takes (docs/benchmarks.md, "Figures
# behind the defaults").
VIDEO_POOL_PROCESSES = 16


def decode_pool(for_videos: bool = False) -> Executor | None:
    """The process's pool (None with VLM_CAPTION_DECODE_PROCESSES=0: decode in the caller). Made
    first for videos, it has at most VIDEO_POOL_PROCESSES unless the setting names a number."""
    global _POOL, _POOL_SIZE
    if decode_processes() <= 0:
        return None
    with _LOCK:
        if _POOL is None:
            workers = decode_processes()
            if for_videos and get_settings().decode_processes is None:
                workers = min(workers, VIDEO_POOL_PROCESSES)
            _POOL = ProcessPoolExecutor(max_workers=workers, mp_context=_decode_context(for_videos),
                                        initializer=_start_worker,
                                        initargs=(get_settings().decode_niceness, for_videos,
                                                  get_settings().decode_threads))
            _POOL_SIZE = workers
            atexit.register(_POOL.shutdown, wait=False, cancel_futures=True)
        return _POOL


def _decode_context(for_videos: bool):
    """The pool's processes are forked from one fork server, not spawned: a spawned process
    imports the parent's main module again (the CLI, Prefect's engine) and, for videos, vLLM's
    loader, each of them at once beside the engine's build. The server imports those once
    (tasks/media/video_preload.py) and has no threads to fork, unlike the flow's process."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["vlm_caption.tasks.media.pool"] + (["vlm_caption.tasks.media.video_preload"] if for_videos else []))
    return context


def start_decode_pool(modality: str) -> None:
    """For a video run that decodes in the pool: start every pool process now, beside the
    engine's start, so their imports of vLLM's loader are over before the first shard's clips
    (started at the first clip, they held the first generation back 14 s on 2x H200). The pool
    starts a process per task submitted while none is idle."""
    if modality != "video" or not videos_in_pool() or (pool := decode_pool(for_videos=True)) is None:
        return
    for _ in range(_POOL_SIZE):
        pool.submit(os.getpid)


def decode_images(blobs: list[bytes], max_pixels: int, target: ImageResize | None):
    """Decode every blob (in the pool when there is one); the first error stops the item."""
    pool = decode_pool()
    if pool is None:
        return [decode_job(blob, max_pixels, target) for blob in blobs]
    return [future.result() for future in [pool.submit(decode_job, b, max_pixels, target) for b in blobs]]


def decode_video_pooled(data: bytes, *, num_frames: int, limits: VideoLimits,
                        resize: FrameResize | None = None) -> DecodedVideo:
    """One video, decoded (and its frames resized) in the pool where `videos_in_pool`, else here.
    A process decodes one video at a time (tasks/media/video.py), so without the pool a process's
    clips are decoded one after another (tasks/settings.py says what that costs)."""
    pool = decode_pool(for_videos=True) if videos_in_pool() else None
    if pool is None:
        return decode_video(data, num_frames=num_frames, limits=limits, resize=resize)
    video = pool.submit(decode_video_job, data, num_frames, limits, resize).result()
    video.frames = taken(video.frames)
    return video
