"""Small image files for tests."""

from __future__ import annotations

import io


def image_bytes(fmt: str = "JPEG", size=(64, 48), color=(200, 40, 40), mode: str = "RGB", exif_orientation: int | None = None) -> bytes:
    from PIL import Image

    image = Image.new(mode, size, color if mode == "RGB" else color + (128,) if mode == "RGBA" else 128)
    buffer = io.BytesIO()
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        image.save(buffer, fmt, exif=exif)
    else:
        image.save(buffer, fmt)
    return buffer.getvalue()


def corrupt_jpeg() -> bytes:
    data = image_bytes("JPEG", size=(256, 256))
    return data[: len(data) // 3]  # header intact, pixels cut off
