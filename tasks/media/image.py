"""Decode fetched bytes into what vLLM takes: RGB PIL images, upright, within a pixel budget."""

from __future__ import annotations

import contextlib
import io
import re
import threading
import warnings
from collections.abc import Iterator

from vlm_caption.tasks.records import ItemError


class MediaError(Exception):
    def __init__(self, error: ItemError):
        super().__init__(error.message)
        self.error = error

    def __reduce__(self):  # whole across the decode pool's process boundary
        return MediaError, (self.error,)


def decode_image(data: bytes, *, max_pixels: int):
    """Bytes -> RGB PIL image with EXIF orientation applied. Raises MediaError for non-images,
    truncated/corrupt files and images over `max_pixels` (decompression bombs)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with _pillow_limit(max_pixels), warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:  # where Pillow's check is not reached (a format's own path)
                raise MediaError(_too_large(f"{width}x{height} = {width * height:,} pixels", max_pixels))
            image.load()  # decode now, so corrupt data fails here and not inside vLLM
            image = ImageOps.exif_transpose(image)
            if image.mode != "RGB":
                image = _to_rgb(image)
            return image
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError(ItemError("decode", "not an image Pillow can read")) from None
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        size = re.search(r"\((\d+) pixels\)", str(exc))  # Pillow names the size it read from the header
        raise MediaError(_too_large(f"{int(size[1]):,} pixels" if size else "declared larger", max_pixels)) from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(ItemError("decode", f"corrupt image: {exc}")) from None


_limit_lock = threading.Lock()
_decoding = 0  # decodes under way in this process
_pillow_default: int | None = None


@contextlib.contextmanager
def _pillow_limit(max_pixels: int) -> Iterator[None]:
    """Pillow's own refusal of big images (wherever a format checks: a warning above
    Image.MAX_IMAGE_PIXELS, an error above twice it) made the product's limit while images decode
    here, not Pillow's default of 89,478,485 pixels. The value is module-wide: it is set while
    any decode is under way, and Pillow's put back after the last, for whatever else opens
    images in this process."""
    global _decoding, _pillow_default
    from PIL import Image

    with _limit_lock:
        if _decoding == 0:
            _pillow_default = Image.MAX_IMAGE_PIXELS
        _decoding += 1
        Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        yield
    finally:
        with _limit_lock:
            _decoding -= 1
            if _decoding == 0:
                Image.MAX_IMAGE_PIXELS = _pillow_default


def _too_large(size: str, max_pixels: int) -> ItemError:
    return ItemError("too_large", f"image is {size}, over the limit of {max_pixels:,} pixels; refused before "
                     "decoding (raise VLM_CAPTION_MAX_IMAGE_PIXELS to allow it)")


def _to_rgb(image):
    from PIL import Image

    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        # Flatten transparency onto white instead of black, as a viewer would show it.
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")
