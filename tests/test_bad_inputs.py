"""A corpus of hostile or odd files, made here: each decodes to an upright RGB image of the right
content (the first frame or page) or fails with a readable error, and decoding the lot stays
within a bounded peak memory (a decompression bomb is refused from its header). The same for
videos: no frames, sound only, hours long (sampled, never decoded whole), or over the limit."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import zlib

import pytest

from tests.images import VIDEO_CORPUS_ERRORS, video_corpus


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(side: int = 100_000) -> bytes:
    """A 200-byte PNG that declares 100,000 x 100,000 pixels (30 GB decoded)."""
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header)
            + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + _png_chunk(b"IEND", b""))


def _save(image, fmt, **kw) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kw)
    return buffer.getvalue()


def corpus() -> dict[str, bytes]:
    from PIL import Image

    red = Image.new("RGB", (40, 30), (220, 20, 20))
    frames = [Image.new("RGB", (40, 30), (i * 5, 200, 0)) for i in range(50)]
    palette = Image.new("P", (40, 30), 1)
    palette.putpalette([255, 255, 255, 220, 20, 20] + [0] * 762)
    exif = Image.Exif()
    exif[0x9286] = "x" * 60_000  # UserComment: an APP1 block near JPEG's 64 KB limit
    truncated = _save(Image.effect_noise((256, 256), 60).convert("RGB"), "JPEG")
    return {
        "bomb.png": bomb_png(),
        "truncated.jpg": truncated[: len(truncated) // 3],
        "empty.jpg": b"",
        "deep.png": _save(Image.new("I;16", (40, 30), 40000), "PNG"),
        "cmyk.jpg": _save(Image.new("CMYK", (40, 30), (0, 220, 220, 20)), "JPEG"),
        "palette.png": _save(palette, "PNG", transparency=0),
        "animated.gif": _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=40),
        "pages.tiff": _save(red, "TIFF", save_all=True, append_images=[Image.new("RGB", (40, 30), (0, 0, 255))]),
        "vector.jpg": b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect/></svg>',
        "page.jpg": b"<!doctype html><html><body>not an image</body></html>",
        "doc.jpg": b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF",
        "exif.jpg": _save(red, "JPEG", exif=exif),
    }


EXPECTED_ERRORS = {"bomb.png": "too_large", "truncated.jpg": "decode", "empty.jpg": "decode",
                   "vector.jpg": "decode", "page.jpg": "decode", "doc.jpg": "decode"}
FIRST_PIXEL = {"cmyk.jpg": None, "palette.png": (220, 20, 20), "animated.gif": (0, 200, 0),
               "pages.tiff": (220, 20, 20), "exif.jpg": (220, 20, 20), "deep.png": None}


@pytest.mark.parametrize("name", sorted(corpus()))
def test_each_file_decodes_or_fails_readably(name):
    from vlm_caption.tasks.media.image import MediaError, decode_image

    data = corpus()[name]
    if name in EXPECTED_ERRORS:
        with pytest.raises(MediaError) as caught:
            decode_image(data, max_pixels=64_000_000)
        assert caught.value.error.kind == EXPECTED_ERRORS[name] and caught.value.error.message
        return
    image = decode_image(data, max_pixels=64_000_000)
    assert image.mode == "RGB" and image.size == (40, 30)
    expected = FIRST_PIXEL[name]
    if expected is not None:  # the first frame or page, in its colours (JPEG is close, not exact)
        assert all(abs(a - b) <= 12 for a, b in zip(image.getpixel((5, 5)), expected)), image.getpixel((5, 5))


def rss_growth_kb(setup: str, decode: str) -> int:
    """In a fresh process: peak RSS growth (KB) while `decode` runs on every file of `files`
    (made by `setup`), each MediaError being that file's readable failure."""
    probe = (
        f"import resource\nfrom vlm_caption.tasks.media.image import MediaError\n{setup}\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "for data in files.values():\n"
        f"    try:\n        {decode}\n    except MediaError:\n        pass\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def test_the_whole_corpus_decodes_in_bounded_memory():
    growth = rss_growth_kb("from tests.test_bad_inputs import corpus\nfrom vlm_caption.tasks.media.image import decode_image\n"
                           "files = corpus()", "decode_image(data, max_pixels=64_000_000)")
    assert growth < 100 * 1024  # the bomb's 30 GB were never allocated


@pytest.mark.parametrize("name", sorted(video_corpus()))
def test_each_video_decodes_or_fails_readably(name):
    from vlm_caption.tasks.media.image import MediaError
    from vlm_caption.tasks.media.video import VideoLimits, decode_video

    limits = VideoLimits(max_seconds=3 * 3600, max_frame_pixels=3840 * 2160)
    if name in VIDEO_CORPUS_ERRORS:
        with pytest.raises(MediaError) as caught:
            decode_video(video_corpus()[name], num_frames=16, limits=limits)
        assert caught.value.error.kind == VIDEO_CORPUS_ERRORS[name] and caught.value.error.message
        return
    video = decode_video(video_corpus()[name], num_frames=16, limits=limits)
    info = video.info()
    assert (info["frames"], info["width"], info["height"], info["duration_s"]) == (16, 16, 16, 7200.0)
    first, last = (int(value) for value in video.frames[0, 0, 0, :2]), int(video.frames[-1, 0, 0, 1])
    red, green = first
    assert red < 12 and green < 12  # RGB of the writer's first BGR frame (blue bands, green 0)
    assert video.metadata["frames_indices"][-1] > 6000  # sampled over the whole two hours
    assert last > 60  # the last sampled frame is a late one (green grows by 5 a frame), not frame 0 again


def test_the_video_corpus_decodes_in_bounded_memory():
    growth = rss_growth_kb(
        "from tests.images import video_corpus\nfrom vlm_caption.tasks.media.video import VideoLimits, decode_video\n"
        "files = video_corpus()\n"
        "decode_video(files['two-hours.mp4'], num_frames=2, limits=VideoLimits(1e5, 10**7))  # warm the loader",
        "decode_video(data, num_frames=16, limits=VideoLimits(3 * 3600, 3840 * 2160))")
    assert growth < 100 * 1024  # hours of video, never held whole
