"""Decode fetched bytes into what vLLM takes: RGB PIL images, upright, within a pixel budget."""

from __future__ import annotations

import io
import warnings

from tasks.results.records import ItemError


class MediaError(Exception):
    def __init__(self, error: ItemError):
        super().__init__(error.message)
        self.error = error


def decode_image(data: bytes, *, max_pixels: int):
    """Bytes -> RGB PIL image with EXIF orientation applied.

    Raises MediaError for non-images, truncated/corrupt files and images over `max_pixels`
    (decompression bombs): the caller records the error and moves on.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise MediaError(ItemError(
                    "too_large",
                    f"image is {width}x{height} = {width * height} pixels, over the limit of "
                    f"{max_pixels} (raise VLM_CAPTION_MAX_IMAGE_PIXELS to allow it)",
                ))
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
        raise MediaError(ItemError(
            "too_large", f"declared image size is a decompression bomb ({exc}); refused before decoding "
            "(raise VLM_CAPTION_MAX_IMAGE_PIXELS to allow large images)")) from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise MediaError(ItemError("decode", f"corrupt image: {exc}")) from None


def _to_rgb(image):
    from PIL import Image

    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        # Flatten transparency onto white instead of black, as a viewer would show it.
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")
