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


def video_bytes(frames: int = 24, fps: int = 8, size=(64, 48), seed: int = 0) -> bytes:
    """A short MP4 (MPEG-4 part 2, which every OpenCV build writes) of moving colour bands."""
    import os
    import tempfile

    import cv2
    import numpy as np

    width, height = size
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        for i in range(frames):
            frame = np.zeros((height, width, 3), np.uint8)
            frame[:, :, 0] = (np.arange(width) * 4 + i * 9 + seed * 50) % 256
            frame[:, :, 1] = (seed * 80 + i * 5) % 256
            writer.write(frame)
        writer.release()
        with open(path, "rb") as handle:
            return handle.read()
    finally:
        os.unlink(path)
