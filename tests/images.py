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


def video_bytes(frames: int = 24, fps: float = 8, size=(64, 48), seed: int = 0) -> bytes:
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


def _box(kind: bytes, payload: bytes, full: int | None = None) -> bytes:
    """One ISO-BMFF (MP4) box; `full` is a full box's version-and-flags word."""
    import struct

    head = b"" if full is None else struct.pack(">I", full)
    return struct.pack(">I", 8 + len(head) + len(payload)) + kind + head + payload


def audio_only_mp4(seconds: int = 2, rate: int = 8000) -> bytes:
    """A valid MP4 whose one track is sound (16-bit PCM), as a phone's voice memo: no video stream."""
    import struct

    import numpy as np

    samples = seconds * rate
    pcm = (np.sin(np.arange(samples) * 0.05) * 8000).astype("<i2").tobytes()
    matrix = struct.pack(">9I", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)
    ftyp = _box(b"ftyp", b"isom" + struct.pack(">I", 512) + b"isommp41")
    entry = _box(b"sowt", b"\0" * 6 + struct.pack(">HHH4sHHHHI", 1, 0, 0, b"\0" * 4, 1, 16, 0, 0, rate << 16))
    stbl = _box(b"stbl", _box(b"stsd", struct.pack(">I", 1) + entry, 0)
                + _box(b"stts", struct.pack(">III", 1, samples, 1), 0)
                + _box(b"stsc", struct.pack(">IIII", 1, 1, samples, 1), 0)
                + _box(b"stsz", struct.pack(">II", 2, samples), 0)
                + _box(b"stco", struct.pack(">II", 1, len(ftyp) + 8), 0))  # the PCM follows ftyp in mdat
    minf = _box(b"minf", _box(b"smhd", b"\0" * 4, 0)
                + _box(b"dinf", _box(b"dref", struct.pack(">I", 1) + _box(b"url ", b"", 1), 0)) + stbl)
    mdia = _box(b"mdia", _box(b"mdhd", struct.pack(">IIIIHH", 0, 0, rate, samples, 0x55C4, 0), 0)
                + _box(b"hdlr", struct.pack(">I4s12s", 0, b"soun", b"\0" * 12) + b"SoundHandler\0", 0) + minf)
    tkhd = _box(b"tkhd", struct.pack(">IIIII8sHHHH", 0, 0, 1, 0, seconds * 1000, b"\0" * 8, 0, 0, 0x100, 0)
                + matrix + struct.pack(">II", 0, 0), 7)
    mvhd = _box(b"mvhd", struct.pack(">IIIIIH10s", 0, 0, 1000, seconds * 1000, 0x10000, 0x100, b"\0" * 10)
                + matrix + b"\0" * 24 + struct.pack(">I", 2), 0)
    return ftyp + _box(b"mdat", pcm) + _box(b"moov", mvhd + _box(b"trak", tkhd + mdia))


def video_corpus() -> dict[str, bytes]:
    """Odd videos a bucket holds: no frames, sound only, hours long (1 fps, 16x16, so small)."""
    return {
        "no-frames.mp4": video_bytes(frames=0),
        "audio-only.mp4": audio_only_mp4(),
        "two-hours.mp4": video_bytes(frames=2 * 3600, fps=1, size=(16, 16)),  # under the 3 h default limit
        "four-hours.mp4": video_bytes(frames=4 * 3600, fps=1, size=(16, 16)),  # over it
        "text.mp4": b"just some text, named like a video",
    }


VIDEO_CORPUS_ERRORS = {"no-frames.mp4": "decode", "audio-only.mp4": "decode", "four-hours.mp4": "too_large",
                       "text.mp4": "decode"}
