import pytest

from vlm_caption.tasks.media.image import MediaError, decode_image
from tests.images import corrupt_jpeg, image_bytes


def test_exif_orientation_is_applied():
    # Orientation 6 = rotated 90 degrees: a 64x48 file shows as 48x64.
    image = decode_image(image_bytes("JPEG", size=(64, 48), exif_orientation=6), max_pixels=10**6)
    assert image.size == (48, 64)


@pytest.mark.parametrize("fmt, mode", [("PNG", "RGBA"), ("PNG", "L"), ("WEBP", "RGB"), ("GIF", "RGB")])
def test_any_mode_becomes_rgb(fmt, mode):
    assert decode_image(image_bytes(fmt, mode=mode), max_pixels=10**6).mode == "RGB"


def test_transparency_is_flattened_onto_white():
    from PIL import Image
    import io

    buf = io.BytesIO()
    Image.new("RGBA", (4, 4), (0, 0, 0, 0)).save(buf, "PNG")
    assert decode_image(buf.getvalue(), max_pixels=100).getpixel((0, 0)) == (255, 255, 255)


def test_corrupt_image_is_a_decode_error():
    with pytest.raises(MediaError) as info:
        decode_image(corrupt_jpeg(), max_pixels=10**6)
    assert info.value.error.kind == "decode" and not info.value.error.retryable


def test_non_image_is_a_decode_error():
    with pytest.raises(MediaError, match="not an image"):
        decode_image(b"just some text, not pixels", max_pixels=10**6)


def test_pixel_guard_refuses_huge_images_without_decoding_them():
    with pytest.raises(MediaError) as info:
        decode_image(image_bytes("PNG", size=(200, 100)), max_pixels=10_000)
    assert info.value.error.kind == "too_large" and "VLM_CAPTION_MAX_IMAGE_PIXELS" in str(info.value)


def big_png(side: int) -> bytes:
    """A side x side PNG of one colour: compressed small (10000 x 10000 is about 100 KB)."""
    from PIL import Image
    import io

    buffer = io.BytesIO()
    Image.new("L", (side, side)).save(buffer, "PNG")
    return buffer.getvalue()


def test_the_products_pixel_limit_is_the_one_applied_and_named():
    """100,000,000 pixels: over the product's 64,000,000 and over Pillow's own 89,478,485. The error
    names the product's limit and the setting that moves it, never Pillow's (issue 65)."""
    from PIL import Image

    before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(MediaError) as info:
        decode_image(big_png(10_000), max_pixels=64_000_000)
    error = info.value.error
    assert error.kind == "too_large" and not error.retryable
    assert "64,000,000" in error.message and "VLM_CAPTION_MAX_IMAGE_PIXELS" in error.message
    assert "100,000,000 pixels" in error.message
    assert "89478485" not in error.message and "178956970" not in error.message
    assert Image.MAX_IMAGE_PIXELS == before  # Pillow's own value back for whatever else opens images


def test_a_limit_above_pillows_own_lets_the_image_through(monkeypatch):
    """Raised above Pillow's limit (here made small), the product's setting is what decides."""
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000)
    assert decode_image(big_png(60), max_pixels=10_000).size == (60, 60)  # 3,600 > Pillow's 1,000
    with pytest.raises(MediaError, match="over the limit of 2,000 pixels"):
        decode_image(big_png(60), max_pixels=2_000)
    assert Image.MAX_IMAGE_PIXELS == 1_000


def test_a_prepared_shard_counts_the_bytes_of_its_decoded_media():
    """The engine feed is bounded by these bytes (`feed_media_bytes`): RGB pixels of an image,
    of every image of a group, every frame of a video; an item that failed holds none."""
    import numpy as np
    from PIL import Image

    from vlm_caption.tasks.prepare import PreparedItem, PreparedShard
    from vlm_caption.tasks.media.video import DecodedVideo
    from vlm_caption.tasks.records import ItemError
    from vlm_caption.tasks.sources.items import ObjectRef, Shard, WorkItem

    item = WorkItem(id="a", members=[ObjectRef(key="a", size=1)])
    image = PreparedItem(item, ("q",), media=Image.new("RGB", (40, 30)))
    group = PreparedItem(item, ("q",), media=[Image.new("RGB", (10, 10)), Image.new("RGB", (20, 10))])
    video = PreparedItem(item, ("q",), media=DecodedVideo(np.zeros((4, 8, 16, 3), np.uint8), {}))
    failed = PreparedItem(item, ("q",), error=ItemError("decode", "corrupt image"))
    assert [p.media_bytes for p in (image, group, video, failed)] == [3600, 900, 1536, 0]
    shard = PreparedShard(Shard(index=0, items=[item]), items=[image, group, video, failed])
    assert shard.media_bytes == 3600 + 900 + 1536


def test_the_decode_pool_has_one_process_per_core_this_process_may_use(monkeypatch):
    """A container's cpuset (or `taskset`) limits the cores, not the host's count."""
    import os

    from vlm_caption.tasks.media.pool import decode_processes
    from vlm_caption.tasks.settings import get_settings

    monkeypatch.delenv("VLM_CAPTION_DECODE_PROCESSES", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5, 7}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    get_settings.cache_clear()
    assert decode_processes() == 3
    monkeypatch.setenv("VLM_CAPTION_DECODE_PROCESSES", "5")
    get_settings.cache_clear()
    assert decode_processes() == 5
    get_settings.cache_clear()
