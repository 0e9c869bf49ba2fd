"""Decode fetched bytes into what vLLM takes for a video: sampled frames, and the metadata that
some models need, through vLLM's own video loader so they match what vLLM's server builds."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from vlm_caption.tasks.media.image import MediaError
from vlm_caption.tasks.records import ItemError

DEFAULT_NUM_FRAMES = 16  # the examples' --num-frames
# One video decode at a time per process: a decode holds a whole video's bytes and frames, and
# OpenCV spreads one decode over the cores. Where VLM_CAPTION_VIDEO_DECODE_IN_POOL says (by default
# where a GPU is seen) the flow decodes in the decode pool's processes (tasks/media/pool.py),
# several clips at once, one in each.
_DECODE_LOCK = threading.Lock()


@dataclass(frozen=True)
class VideoLimits:
    max_seconds: float
    max_frame_pixels: int


@dataclass
class DecodedVideo:
    frames: Any  # numpy array (frames, height, width, 3), uint8 RGB
    metadata: dict[str, Any]  # vLLM's: total_num_frames, fps, duration, frames_indices, ...
    source_size: tuple[int, int] | None = None  # (height, width) as decoded, before any resize

    def info(self) -> dict[str, Any]:
        """What a record says about the video (its own frame size, not the model's)."""
        count, height, width = self.frames.shape[:3]
        height, width = self.source_size or (height, width)
        return {"frames": int(count), "duration_s": round(float(self.metadata.get("duration") or 0.0), 3),
                "fps": round(float(self.metadata.get("fps") or 0.0), 3), "width": int(width),
                "height": int(height), "total_frames": int(self.metadata.get("total_num_frames") or 0)}

    def for_request(self, with_metadata: bool):
        """Frames, or `(frames, metadata)` for models that sample by timestamps (Qwen3-VL, GLM-4.xV)."""
        return (self.frames, self.metadata) if with_metadata else self.frames


def video_loader():
    """vLLM's registered loader (OpenCV by default; VLLM_VIDEO_LOADER_BACKEND picks another)."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # as tasks/engine/vllm_api.py before_vllm_import says
    from vllm.multimodal.video import VIDEO_LOADER_REGISTRY

    return VIDEO_LOADER_REGISTRY.load(os.environ.get("VLLM_VIDEO_LOADER_BACKEND", "opencv"))


def decode_video(data: bytes, *, num_frames: int, limits: VideoLimits, resize=None) -> DecodedVideo:
    """Bytes -> `num_frames` uniformly sampled RGB frames plus metadata; `resize` (a
    `FrameResize`) shrinks the frames. Raises MediaError for empty, undecodable, frameless
    (audio-only) and over-limit videos."""
    if not data:
        raise MediaError(ItemError("decode", "empty file (0 bytes)"))
    with _DECODE_LOCK:
        _check_header(data, limits)
        try:
            frames, metadata = video_loader().load_bytes(data, num_frames=num_frames)
        except Exception as exc:  # noqa: BLE001 - cv2/av raise many kinds; each is this item's error
            raise MediaError(ItemError("decode", f"not a video that can be decoded: {exc}")) from None
    if frames is None or len(frames) == 0:
        raise MediaError(ItemError("decode", "the video has no decodable frames (audio only?)"))
    _check_duration(float(metadata.get("duration") or 0.0), limits)
    source_size = (int(frames.shape[1]), int(frames.shape[2]))
    if resize is not None:
        frames = resize.apply(frames)
    return DecodedVideo(frames, dict(metadata), source_size)


def _check_duration(seconds: float, limits: VideoLimits) -> None:
    if seconds > limits.max_seconds:
        raise MediaError(ItemError(
            "too_large", f"video is {seconds:.0f} s long, over the limit of {limits.max_seconds:.0f} s "
            "(raise VLM_CAPTION_MAX_VIDEO_SECONDS to allow it)"))


def _check_header(data: bytes, limits: VideoLimits) -> None:
    """Refuse huge frames and over-long videos from the container header, before decoding a
    single frame (vLLM's own frame guard reads VLLM_MAX_IMAGE_PIXELS instead)."""
    loader = video_loader()
    api = getattr(loader, "get_cv2_video_api", None)
    if api is None:  # not the OpenCV backend: its own guards apply
        return
    import io

    import cv2

    # Keep the stream referenced until the capture is released: OpenCV reads it through a
    # callback, and releasing a capture whose stream was collected crashes the process.
    stream = io.BytesIO(data)
    capture = cv2.VideoCapture(stream, api(), [])
    if not capture.isOpened():
        raise MediaError(ItemError("decode", "not a video that can be decoded: no video stream could be "
                                             "opened (sound only, no frames, or not a video file)"))
    try:
        width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        fps = capture.get(cv2.CAP_PROP_FPS)
        seconds = capture.get(cv2.CAP_PROP_FRAME_COUNT) / fps if fps > 0 else 0.0
    finally:
        capture.release()
        del stream
    if width * height > limits.max_frame_pixels:
        raise MediaError(ItemError(
            "too_large", f"video frames are {width}x{height}, over the limit of {limits.max_frame_pixels} "
            "pixels (raise VLM_CAPTION_MAX_VIDEO_FRAME_PIXELS to allow it)"))
    _check_duration(seconds, limits)
