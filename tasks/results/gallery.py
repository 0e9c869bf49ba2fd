"""A page to look at a run: one self-contained HTML file next to its manifest showing a sample of
its items, each with a small picture (a thumbnail, or a video's strip of frames) as a data URI;
gallery_page.py writes the HTML. Its size is bounded whatever the run's; what does not fetch or
decode within `VLM_CAPTION_GALLERY_FETCH_S` shows a placeholder."""

from __future__ import annotations

import base64
import io
import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.results.parquet import read_records
from vlm_caption.tasks.results.gallery_page import GalleryItem, publish_gallery, render_gallery
from vlm_caption.tasks.results.layout import manifest_key
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.settings import get_settings
from vlm_caption.tasks.sources.storage import Storage, key_within
from vlm_caption.tasks.tiny_checkpoint import is_tiny_checkpoint

if TYPE_CHECKING:
    from vlm_caption.tasks.sources.formats import SourceSpec

THUMB_PIXELS = 160
THUMB_QUALITY = 70
THUMB_BYTES = 48 << 10  # a thumbnail over this is left out (a placeholder stands in)
THUMB_SOURCE_BYTES = 64 << 20  # an item larger than this is not fetched again for its thumbnail
FETCHERS = 16
STRIP_FRAMES = 4  # frames in a video item's strip, evenly spaced over the video
STRIP_PIXELS = 96  # a strip frame's long side


def gallery_key(run_id: str) -> str:
    return manifest_key(run_id).removesuffix(".json") + ".html"


def sample_items(records: Iterable[ResultRecord], limit: int) -> list[GalleryItem]:
    """At most `limit` items, a reservoir sample of the failed, of the flagged (by the caption
    checks) and of the others: failed ones get up to a quarter of the places, flagged ones come
    next, then the others; memory is the sample's, however many records stream by. An item's
    records (one per question) come together in a part, and are taken together."""
    rng = random.Random(0)
    rooms = (max(1, limit // 4) if limit else 0, limit, limit)  # failed, flagged, the others
    chosen: tuple[list[GalleryItem], ...] = ([], [], [])
    seen = [0, 0, 0]
    for key, group in itertools.groupby(records, key=lambda r: r.key):
        item = GalleryItem(key, list(group))
        rank = 0 if item.failed else 1 if item.flagged else 2
        seen[rank] += 1
        if len(chosen[rank]) < rooms[rank]:
            chosen[rank].append(item)
        elif (slot := rng.randrange(seen[rank])) < rooms[rank]:
            chosen[rank][slot] = item
    items = (chosen[0] + chosen[1] + chosen[2])[:limit]
    return sorted(items, key=lambda item: (not item.failed, not item.flagged, item.key))


def _jpeg(image, limit: int = THUMB_BYTES) -> str | None:
    """A PIL image as a JPEG data URI, or None when it comes out over `limit` bytes."""
    out = io.BytesIO()
    image.save(out, "JPEG", quality=THUMB_QUALITY)
    if out.tell() > limit:
        return None
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


def thumbnail(data: bytes) -> str | None:
    """A small JPEG as a data URI, or None when the bytes are not an image PIL opens."""
    from PIL import Image, ImageOps

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.draft("RGB", (THUMB_PIXELS, THUMB_PIXELS))  # JPEG: decode at a fraction of the size
            image = ImageOps.exif_transpose(image).convert("RGB")
            image.thumbnail((THUMB_PIXELS, THUMB_PIXELS))
            return _jpeg(image)
    except Exception:  # noqa: BLE001 - a corrupt image is shown as its error, not as a picture
        return None


def frame_strip(data: bytes) -> list[str]:
    """STRIP_FRAMES evenly spaced frames of a video as small JPEG data URIs, decoded (and shrunk
    to STRIP_PIXELS) as the captioning decodes its clips, in the decode pool where it does; []
    when the video does not decode or its strip would be over THUMB_BYTES."""
    from PIL import Image

    from vlm_caption.tasks.media.image import MediaError
    from vlm_caption.tasks.media.pool import decode_video_pooled
    from vlm_caption.tasks.media.resize import FrameThumbnails
    from vlm_caption.tasks.media.video import VideoLimits

    settings = get_settings()
    try:
        video = decode_video_pooled(data, num_frames=STRIP_FRAMES, resize=FrameThumbnails(STRIP_PIXELS),
                                    limits=VideoLimits(settings.max_video_seconds, settings.max_video_frame_pixels))
        limit = THUMB_BYTES // max(1, len(video.frames))  # the frames were shrunk where they were decoded
        uris = [_jpeg(Image.fromarray(frame).convert("RGB"), limit) for frame in video.frames]
        return [] if None in uris else uris
    except MediaError:  # an undecodable video shows its placeholder (its record says why)
        return []
    except Exception as exc:  # noqa: BLE001 - a picture is a nicety: its placeholder, and the cause logged
        get_logger().warning("gallery: a video's strip could not be made (placeholder shown)",
                             error=f"{type(exc).__name__}: {exc}")
        return []


def build_gallery(records: Iterable[ResultRecord], fetch: Callable[[ResultRecord], bytes | None],
                  limit: int, title: str, summary: dict, fetch_s: float = 20.0) -> tuple[str, list[GalleryItem]]:
    """The page's HTML and the items on it; `fetch` gives an item's image (or video) bytes.
    Pictures not made within `fetch_s` seconds show placeholders."""
    from vlm_caption.tasks.media.pool import usable_cores

    items = sample_items(records, limit)
    if any(record.model and is_tiny_checkpoint(record.model) for item in items[:1] for record in item.records[:1]):
        summary = {**summary, "note": "random-weight test model: its captions are noise"}
    # Videos fetched and decoded at once: half the cores this process may use, at least 2 and at
    # most FETCHERS. Each slot holds a whole video (up to THUMB_SOURCE_BYTES), so not one per
    # fetcher; where the run decodes its clips in the decode pool (a GPU host), the strips are
    # decoded there side by side. The run ends once its page is written.
    decoding = threading.BoundedSemaphore(max(2, min(FETCHERS, usable_cores() // 2)))
    unfetched: list[str] = []  # items whose media could not be read again (each shows a placeholder)

    def read(record: ResultRecord) -> bytes | None:
        try:
            return fetch(record)
        except Exception as exc:  # noqa: BLE001 - a picture is a nicety: a placeholder, counted and logged below
            unfetched.append(f"{record.key}: {type(exc).__name__}: {exc}")
            return None

    def picture(item: GalleryItem) -> tuple[str | None, list[str]]:
        first = item.records[0]
        if first.size > THUMB_SOURCE_BYTES:
            return None, []
        if first.video:
            with decoding:  # that many whole videos in memory at a time
                data = read(first)
                return None, frame_strip(data) if data else []
        data = read(first)
        return thumbnail(data) if data else None, []

    # Each item's picture, FETCHERS at a time (object stores answer in parallel), for at most
    # `fetch_s` seconds. The threads are daemons: one still waiting on a store when time is up
    # keeps neither the run nor the process from ending, and what it makes then is dropped.
    todo, lock, closed = deque(items), threading.Lock(), threading.Event()

    def work() -> None:
        while True:
            with lock:
                if closed.is_set() or not todo:
                    return
                item = todo.popleft()
            thumb, strip = picture(item)
            with lock:
                if not closed.is_set():
                    item.thumbnail, item.strip = thumb, strip

    threads = [threading.Thread(target=work, name=f"gallery-{i}", daemon=True) for i in range(min(FETCHERS, len(items)))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + fetch_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:  # a picture made from here on is dropped, never half-written into the page
        closed.set()
    if unfetched:
        get_logger().warning("gallery: media could not be read again for their pictures (placeholders shown)",
                             items=len(unfetched), first=unfetched[:3])
        summary = {**summary, "pictures not fetched": len(unfetched)}
    return render_gallery(items, title, summary), items


def run_records(out: Storage, parts: list[str], unreadable: list[str] | None = None) -> Iterator[ResultRecord]:
    """The records of the run's own parts, nothing else: the page costs what the run added, never
    the history. A part that cannot be read is logged and added to `unreadable`."""
    for key in (key_within(out, p) for p in parts):
        try:
            records = read_records(out, key)
        except Exception as exc:  # noqa: BLE001 - logged and named: its items are not shown
            get_logger().warning("gallery: a results part could not be read; its items are not shown",
                                 part=out.describe(key), error=f"{type(exc).__name__}: {exc}")
            if unreadable is not None:
                unreadable.append(out.describe(key))
            continue
        yield from records


def media_fetcher(source: SourceSpec) -> Callable[[ResultRecord], bytes | None]:
    """How to read an item's (first) image or video again for its picture: the source format's
    reader locates the member a record names and reads it, as the captioning did."""
    from vlm_caption.tasks.sources.reader import BAD_INPUT
    from vlm_caption.tasks.sources.registry import open_reader

    reader = open_reader(source)

    def fetch(record: ResultRecord) -> bytes | None:
        if record.error is not None and record.error.get("kind") in (BAD_INPUT, "too_large"):
            return None  # refused media (a name, a link out, a bomb): a thumbnail would read or decode them
        member = (record.members or [record])[0]
        ref = reader.locate(record.key, member.key, member.size, member.etag)
        return reader.read_member(ref) if ref is not None else None

    return fetch


def gallery_after_run(out: Storage, source: SourceSpec, run_id: str, parts: list[str], *, items: int, title: str,
                      fingerprint: str, facts: dict) -> dict:
    """Write the run's gallery of at most `items` items (none: 0) next to its manifest, its
    pictures read again from `source`, and link it from a Prefect artifact; a failure is reported
    in the manifest, never raised. `facts`: the run's counts and cost, for the page's heading."""
    if items <= 0:
        return {"path": None}
    try:
        began = time.monotonic()
        unreadable: list[str] = []
        page, shown = build_gallery(run_records(out, parts, unreadable), media_fetcher(source), items, title,
                                    {"run": run_id, **facts, "fingerprint": fingerprint},
                                    get_settings().gallery_fetch_s)
        out.write(gallery_key(run_id), page.encode())
        path = out.describe(gallery_key(run_id))
        shown_in_ui = publish_gallery(out, gallery_key(run_id), shown)  # a link or a table the UI opens
        # build_s: the run's end waits for its page (its pictures read and decoded again)
        return {"path": path, "items": len(shown), "bytes": len(page), "build_s": round(time.monotonic() - began, 2),
                **shown_in_ui,
                **({"unreadable_parts": unreadable} if unreadable else {})}
    except Exception as exc:  # noqa: BLE001 - the page is a view; the run's results stand
        get_logger(run_id=run_id).warning("gallery not written", error=str(exc))
        return {"path": None, "error": f"{type(exc).__name__}: {exc}"}
