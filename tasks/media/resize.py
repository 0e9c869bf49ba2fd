"""Shrink images to what the model's own processor would produce anyway, before vLLM sees them:
vLLM renders every image through the model's HF processor in one process, where a 1920x1080
photo costs far more than the 336x448 the processor resizes it to first; the decode pool's many
processes take that work off vLLM's critical path. Only processors whose first step is a plain
downscale are handled, and images are never enlarged. A video's frames can also be shrunk to a
gallery strip's size where they are decoded (`FrameThumbnails`).
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
    try:
        if not path.exists():
            from huggingface_hub import try_to_load_from_cache

            path = Path(try_to_load_from_cache(model, name))  # TypeError where it is not in the cache
        return json.loads(path.read_text())
    except Exception:  # noqa: BLE001 - not a hub id, no cache, unreadable: no resize
        return None


def resize_target(model: str, mm_processor_kwargs: dict[str, Any] | None = None):
    # The image processor's settings from the checkpoint (local folder or hub cache; never a
    # download): `preprocessor_config.json`, or transformers 5's nested `processor_config.json`.
    processor = _read_local_json(model, "preprocessor_config.json")
    if processor is None:
        processor = (_read_local_json(model, "processor_config.json") or {}).get("image_processor")
    if not processor:
        return None
    config = _read_local_json(model, "config.json") or {}
    kind = str(processor.get("image_processor_type", ""))
    size = processor.get("size") or {}
    if (kind.startswith("CLIPImageProcessor") and config.get("model_type") == "llava"
            and processor.get("do_center_crop") and "shortest_edge" in size):
        crop = processor.get("crop_size") or {}
        return ResizeTarget(shortest_edge=int(size["shortest_edge"]),
                            crop=(int(crop["width"]), int(crop["height"])) if "width" in crop and "height" in crop else None)
    if kind.startswith(("Qwen2VLImageProcessor", "Qwen2_5_VLImageProcessor")):
        exact = processor_resize(model, mm_processor_kwargs, "image")
        if exact is not None:  # the processor's own resize, to the very size it would pick
            return exact
        limit = (mm_processor_kwargs or {}).get("max_pixels") or processor.get("max_pixels") or size.get("longest_edge")
        return ResizeTarget(max_pixels=int(limit)) if limit else None
    return None


# ---- the model processor's own resize ---------------------------------------------------------
# Processors whose first step resizes each image or frame to one size computed from it alone
# (Qwen2-VL's `smart_resize`: a multiple of patch x merge within min/max pixels); Qwen2.5-VL uses
# the same ones. Others get the media as decoded (images: the plain downscale above, if any).
RESIZING_PROCESSORS = {"image": ("Qwen2VLImageProcessor",), "video": ("Qwen2VLVideoProcessor",)}


@dataclass(frozen=True)
class ProcessorResize:
    """Resize with the model's own image or video processor, on the CPU of a decode process or
    fetch thread, so the processor in vLLM finds the media at its size already and leaves it be
    (4K frames never carried through the feed). With the processor on the GPU, whose bicubic
    kernel differs from the CPU's by a few 8-bit steps, it keeps the CPU path's pixels."""

    model: str
    pixels: tuple[tuple[str, int], ...] = ()  # min_pixels / max_pixels from mm_processor_kwargs
    media: str = "video"  # or "image"

    def apply(self, media):
        """A PIL image, or (frames, height, width, 3) uint8 frames -> the same at the processor's size."""
        import numpy as np
        import torch

        if self.media == "image":
            batch = torch.from_numpy(np.array(media.convert("RGB"))).permute(2, 0, 1)[None]
        else:
            batch = torch.from_numpy(np.ascontiguousarray(media)).permute(0, 3, 1, 2)[None]
        processor = _processor(self.model, self.pixels, self.media)
        factor = processor.patch_size * processor.merge_size
        resized = processor.resize(batch, size=processor.size, resample=processor.resample, factor=factor)
        if tuple(resized.shape[-2:]) == tuple(batch.shape[-2:]):
            return media
        if self.media == "image":
            from PIL import Image

            return Image.fromarray(resized[0].permute(1, 2, 0).contiguous().numpy())
        return resized[0].permute(0, 2, 3, 1).contiguous().numpy()


# What the decode pool may do to an image: a plain downscale, or the processor's own resize.
ImageResize = ResizeTarget | ProcessorResize


@dataclass(frozen=True)
class FrameThumbnails:
    """Video frames shrunk to at most `pixels` on the long side (PIL's thumbnail) where they are
    decoded: a gallery strip's decode process sends back a few small frames, not whole ones."""

    pixels: int

    def apply(self, frames):
        import numpy as np
        from PIL import Image

        def shrink(frame):
            image = Image.fromarray(frame)
            image.thumbnail((self.pixels, self.pixels))
            return np.asarray(image)

        return np.stack([shrink(frame) for frame in frames]) if len(frames) else frames


FrameResize = ProcessorResize | FrameThumbnails  # what a video's decode may shrink its frames with


def processor_resize(model: str, mm_processor_kwargs: dict[str, Any] | None, media: str) -> ProcessorResize | None:
    """The checkpoint's own resize for `media` ("image" or "video"), or None (a processor not
    listed, no local config, a processor that caps pixels by frame count)."""
    pixels = tuple(sorted((k, int(v)) for k, v in (mm_processor_kwargs or {}).items()
                          if k in ("min_pixels", "max_pixels") and v is not None))
    try:
        processor = _processor(model, pixels, media)
    except Exception:  # noqa: BLE001 - no local config, or no processor for this media: as decoded
        return None
    if (type(processor).__name__ not in RESIZING_PROCESSORS[media] or not processor.do_resize
            or getattr(processor, "cap_pixels_per_frame", None)):
        return None
    return ProcessorResize(model, pixels, media)


@functools.lru_cache(maxsize=4)
def _processor(model: str, pixels: tuple[tuple[str, int], ...], media: str):
    """The checkpoint's image or video processor as vLLM builds it (the recipe's pixel limits
    passed at construction); from local files only, never a download."""
    from transformers import AutoImageProcessor, AutoVideoProcessor

    auto = AutoVideoProcessor if media == "video" else AutoImageProcessor
    return auto.from_pretrained(model, local_files_only=True, **dict(pixels))
