"""Shrink images to what the model's own processor would produce anyway, before vLLM sees them.

vLLM renders every image through the model's HF processor in one process; a 1920x1080 photo
costs it far more than the 336x448 the processor resizes it to first. Shrinking in the decode
pool (many processes, overlapped with generation) takes that work off vLLM's critical path.
Only processors whose first step is a plain downscale are handled, and images are never
enlarged; any other processor (any-resolution tiling, image splitting) gets the image as it is.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ResizeTarget:
    shortest_edge: int | None = None  # CLIP-style: resize the shortest edge, then centre-crop
    crop: tuple[int, int] | None = None  # CLIP-style centre crop (width, height) after that resize
    max_pixels: int | None = None  # Qwen-VL-style: at most this many pixels

    def apply(self, image):
        from PIL import Image

        width, height = image.size
        scale = 1.0
        if self.shortest_edge:
            scale = min(scale, self.shortest_edge / min(width, height))
        if self.max_pixels:
            scale = min(scale, math.sqrt(self.max_pixels / (width * height)))
        if scale < 1.0:
            image = image.resize(self._size(width, height, scale), Image.Resampling.BICUBIC)
        return self._centre_crop(image)

    def _size(self, width: int, height: int, scale: float) -> tuple[int, int]:
        if self.shortest_edge and scale == self.shortest_edge / min(width, height):
            # HF's own rounding (the long edge truncated): one pixel off shifts the centre crop's
            # grid, and the model would see visibly different pixels than vLLM alone gives it.
            long = int(self.shortest_edge * max(width, height) / min(width, height))
            return (self.shortest_edge, long) if width <= height else (long, self.shortest_edge)
        return max(1, round(width * scale)), max(1, round(height * scale))

    def _centre_crop(self, image):
        """The processor's own centre crop (HF's offsets), done here so the pixels pickled back
        from the pool and rendered by vLLM are the 336x336 the model sees, not a 597x336 strip.
        Only an image at least the crop's size is cropped: a smaller one HF pads, so it is left."""
        width, height = image.size
        if not self.crop or (width, height) == self.crop or width < self.crop[0] or height < self.crop[1]:
            return image
        left, top = (width - self.crop[0]) // 2, (height - self.crop[1]) // 2
        return image.crop((left, top, left + self.crop[0], top + self.crop[1]))


def _read_local_json(model: str, name: str) -> dict[str, Any] | None:
    path = Path(model) / name
    if not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, name)
        except Exception:  # noqa: BLE001 - not a hub id, or no cache: no resize
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def image_processor_config(model: str) -> dict[str, Any] | None:
    """The image processor's settings from the checkpoint (local folder or hub cache; never a
    download): `preprocessor_config.json`, or transformers 5's nested `processor_config.json`."""
    flat = _read_local_json(model, "preprocessor_config.json")
    if flat is not None:
        return flat
    nested = _read_local_json(model, "processor_config.json") or {}
    return nested.get("image_processor")


def resize_target(model: str, mm_processor_kwargs: dict[str, Any] | None = None) -> ResizeTarget | None:
    processor = image_processor_config(model)
    config = _read_local_json(model, "config.json") or {}
    if not processor:
        return None
    kind = str(processor.get("image_processor_type", ""))
    size = processor.get("size") or {}
    if (kind.startswith("CLIPImageProcessor") and config.get("model_type") == "llava"
            and processor.get("do_center_crop") and "shortest_edge" in size):
        crop = processor.get("crop_size") or {}
        return ResizeTarget(shortest_edge=int(size["shortest_edge"]),
                            crop=(int(crop["width"]), int(crop["height"])) if "width" in crop and "height" in crop else None)
    if kind.startswith(("Qwen2VLImageProcessor", "Qwen2_5_VLImageProcessor")):
        limit = (mm_processor_kwargs or {}).get("max_pixels") or processor.get("max_pixels") or size.get("longest_edge")
        return ResizeTarget(max_pixels=int(limit)) if limit else None
    return None


# ---- video frames -------------------------------------------------------------------------------
# Video processors whose first step is resizing every frame to one size computed from the frame
# alone (Qwen2-VL's `smart_resize`: a multiple of patch x merge within min/max pixels). Qwen2.5-VL
# uses the same one. A processor not listed here gets the frames as decoded.
FRAME_RESIZING_PROCESSORS = ("Qwen2VLVideoProcessor",)


@dataclass(frozen=True)
class FrameTarget:
    """Resize decoded frames with the model's own video processor's resize, so the processor,
    in vLLM, finds them at its size already and leaves them be: the same pixels as resizing them
    there, computed in the fetch threads instead of vLLM's one front-end process, and 4K frames
    are never carried through the feed."""

    model: str
    pixels: tuple[tuple[str, int], ...] = ()  # min_pixels / max_pixels from mm_processor_kwargs

    def apply(self, frames):
        """(frames, height, width, 3) uint8 -> the same, at the processor's size."""
        import numpy as np
        import torch

        processor = _video_processor(self.model, self.pixels)
        videos = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)[None]
        factor = processor.patch_size * processor.merge_size
        resized = processor.resize(videos, size=processor.size, resample=processor.resample, factor=factor)
        if tuple(resized.shape[-2:]) == tuple(videos.shape[-2:]):
            return frames
        return resized[0].permute(0, 2, 3, 1).contiguous().numpy()


def frame_target(model: str, mm_processor_kwargs: dict[str, Any] | None = None) -> FrameTarget | None:
    """The frame resize for this checkpoint's video processor, or None (unknown processor, no
    local config, a processor that caps pixels by frame count)."""
    pixels = tuple(sorted((k, int(v)) for k, v in (mm_processor_kwargs or {}).items()
                          if k in ("min_pixels", "max_pixels") and v is not None))
    try:
        processor = _video_processor(model, pixels)
    except Exception:  # noqa: BLE001 - no local config, or not a video model: frames as decoded
        return None
    if (type(processor).__name__ not in FRAME_RESIZING_PROCESSORS or not processor.do_resize
            or getattr(processor, "cap_pixels_per_frame", None)):
        return None
    return FrameTarget(model, pixels)


@functools.lru_cache(maxsize=4)
def _video_processor(model: str, pixels: tuple[tuple[str, int], ...]):
    """The checkpoint's video processor as vLLM builds it (the recipe's pixel limits passed at
    construction); from local files only, never a download."""
    from transformers import AutoVideoProcessor

    return AutoVideoProcessor.from_pretrained(model, local_files_only=True, **dict(pixels))
