"""The prepare step: fetch each item's media (bounded by bytes in flight), hash it, skip what
is already done, and decode it for its modality. Every item comes out with media or an error."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vlm_caption.tasks.media.image import MediaError
from vlm_caption.tasks.media.pool import decode_images, decode_video_pooled
from vlm_caption.tasks.media.resize import ImageResize, ProcessorResize
from vlm_caption.tasks.media.video import DEFAULT_NUM_FRAMES, DecodedVideo, VideoLimits
from vlm_caption.tasks.results.done_index import DoneIndex
from vlm_caption.tasks.records import ItemError, Member, group_sha256, sha256_hex
from vlm_caption.tasks.same_media import take_copies
from vlm_caption.tasks.settings import get_settings
from vlm_caption.tasks.sources.items import Shard, WorkItem
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.reader import BAD_INPUT, BadInput, SourceReader, TooLargeError
from vlm_caption.tasks.sources.registry import open_reader
from vlm_caption.tasks.sources.storage import ShortBodyError

# Fetches in flight in this process, over every shard being prepared: with the done-index's 16
# readers, within the S3 client's pool of 64 connections (tasks/sources/s3_client.py).
FETCH_CONCURRENCY = 16
# Fetched, not yet decoded bytes held at once by this process (videos are large: bytes, not a count
# of objects): 1 GiB lets all 16 fetches hold a 64 MiB clip; a bigger object goes alone.
MAX_BYTES_IN_FLIGHT = 1024**3


@dataclass(frozen=True)
class MediaOptions:
    modality: str = "image"
    num_frames: int = DEFAULT_NUM_FRAMES
    max_images: int = 8  # a bigger group becomes an error record naming the limit
    resize: ImageResize | None = None  # shrink images to what the model's processor makes of them
    frame_resize: ProcessorResize | None = None  # and video frames, likewise
    dedup: bool = True  # an item whose bytes a done result has takes its answer (tasks/same_media.py)


@dataclass
class PreparedItem:
    """A fetched item: its decoded media (or the error that stopped it) and the questions
    still to compute for it."""

    item: WorkItem
    questions: tuple[str, ...]
    members: list[Member] = field(default_factory=list)
    sha256: str | None = None
    media: Any = None  # PIL image | list of PIL images (a group) | DecodedVideo
    error: ItemError | None = None
    fetch_s: float = 0.0
    decode_s: float = 0.0
    # question -> the done record whose answer it takes: the same bytes (tasks/same_media.py)
    copies: dict[str, Any] = field(default_factory=dict)

    @property
    def media_bytes(self) -> int:
        """Bytes of decoded media this item holds (RGB pixels, video frames)."""
        media = self.media if isinstance(self.media, list) else [self.media]
        return sum(int(m.frames.nbytes) if isinstance(m, DecodedVideo) else m.size[0] * m.size[1] * len(m.getbands())
                   for m in media if m is not None)  # a video's frames, or a PIL image's pixels

    @property
    def video_info(self) -> dict[str, Any] | None:
        """The decoded video's; an item not decoded, as a copy of done results, has theirs."""
        if isinstance(self.media, DecodedVideo):
            return self.media.info()
        return next((record.video for record in self.copies.values() if record.video), None)


@dataclass
class PreparedShard:
    shard: Shard
    items: list[PreparedItem] = field(default_factory=list)
    skipped: int = 0  # items already done by an earlier run with the same fingerprint

    @property
    def media_bytes(self) -> int:
        return sum(item.media_bytes for item in self.items)


class ByteBudget:
    """At most `limit` bytes of fetched media held at once (one object always fits)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._cond = threading.Condition()

    def acquire(self, size: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.used == 0 or self.used + size <= self.limit)
            self.used += size

    def release(self, size: int) -> None:
        with self._cond:
            self.used -= size
            self._cond.notify_all()


def _fetch_error(exc: Exception) -> ItemError:
    if isinstance(exc, BadInput):  # the reader's item error: damage, final
        return ItemError(BAD_INPUT, str(exc))
    if isinstance(exc, TooLargeError):
        return ItemError("too_large", str(exc))
    if isinstance(exc, FileNotFoundError):
        return ItemError("fetch", f"not found: {exc}", retryable=True)
    retry = "" if not isinstance(exc, ShortBodyError) else " (short body)"
    return ItemError("fetch", f"{type(exc).__name__}{retry}: {exc}", retryable=True)


# One of each per process, whichever shard they are for: several shards are prepared at once while
# the engine starts.
_BUDGET = ByteBudget(MAX_BYTES_IN_FLIGHT)
_FETCH_SLOTS = threading.BoundedSemaphore(FETCH_CONCURRENCY)


class ItemPreparer:
    """Fetch, hash, skip and decode one item at a time; shared by one shard's fetch threads."""

    def __init__(self, reader: SourceReader, done: DoneIndex, questions: tuple[str, ...],
                 options: MediaOptions):
        self.reader, self.done, self.questions, self.options = reader, done, questions, options
        self.settings = settings = get_settings()
        self.video_limits = VideoLimits(settings.max_video_seconds, settings.max_video_frame_pixels)

    def prepare(self, item: WorkItem) -> PreparedItem | None:
        """None: every question of the item is already done."""
        pending = self.done.pending_by_listing(item, item.questions or self.questions)
        if not pending:
            return None
        prepared = PreparedItem(item, pending)
        if self.options.modality == "multi-image" and len(item.members) > self.options.max_images:
            prepared.error = ItemError("too_many_images", f"group has {len(item.members)} images, over the "
                                       f"limit of {self.options.max_images} (raise max_images to allow it)")
            prepared.members = [Member(key=m.key, size=m.size, etag=m.etag) for m in item.members]
            return prepared
        if self.options.dedup and take_copies(self.done, prepared, fetched=False):  # by listed MD5s: not fetched
            return prepared
        held = sum(max(m.size, 0) for m in item.members)
        _BUDGET.acquire(held)
        try:
            blobs = self._fetch(prepared)
            if prepared.error is not None:
                return prepared
            prepared.sha256 = (prepared.members[0].sha256 if len(prepared.members) == 1
                               else group_sha256([m.sha256 for m in prepared.members]))
            prepared.questions = self.done.pending_by_content(item.id, prepared.sha256, pending)
            if not prepared.questions:
                return None  # re-uploaded with the same content: already done
            if not (self.options.dedup and take_copies(self.done, prepared)):  # a done result's copy: not decoded
                self._decode(prepared, blobs)
        finally:
            _BUDGET.release(held)
        return prepared

    def _fetch(self, prepared: PreparedItem) -> list[bytes]:
        started, blobs = time.perf_counter(), []
        for ref in prepared.item.members:
            data, error = None, None
            if ref.size > self.settings.max_object_bytes:
                error = ItemError("too_large", f"{ref.key} is {ref.size} bytes, over the limit of "
                                  f"{self.settings.max_object_bytes} (VLM_CAPTION_MAX_OBJECT_BYTES)")
            else:
                try:
                    with _FETCH_SLOTS:
                        data = self.reader.read(prepared.item, ref)
                except Exception as exc:  # noqa: BLE001 - recorded; retryable ones are retried next run
                    error = _fetch_error(exc)
            prepared.members.append(Member(key=ref.key, size=len(data) if data is not None else ref.size,
                                           etag=ref.etag, sha256=sha256_hex(data) if data is not None else None))
            if error is not None:
                prepared.error = error
                prepared.members += [Member(key=m.key, size=m.size, etag=m.etag)
                                     for m in prepared.item.members[len(prepared.members):]]
                break
            blobs.append(data)
        prepared.fetch_s = time.perf_counter() - started
        return blobs

    def _decode(self, prepared: PreparedItem, blobs: list[bytes]) -> None:
        started = time.perf_counter()
        try:
            if self.options.modality == "video":
                prepared.media = decode_video_pooled(blobs[0], num_frames=self.options.num_frames,
                                                     limits=self.video_limits, resize=self.options.frame_resize)
            else:
                images = decode_images(blobs, self.settings.max_image_pixels, self.options.resize)
                prepared.media = images if self.options.modality == "multi-image" else images[0]
        except MediaError as exc:
            prepared.error = exc.error
        prepared.decode_s = time.perf_counter() - started


def prepare_shard(source: SourceSpec, shard: Shard, done: DoneIndex, questions: tuple[str, ...],
                  options: MediaOptions) -> PreparedShard:
    """Fetch (bounded concurrency and bytes), hash and decode one shard, by the source format's reader;
    skip what is done. An item's failure is its error, so nothing here is tried again."""
    preparer = ItemPreparer(open_reader(source), done, questions, options)
    prepared = PreparedShard(shard)
    workers = max(1, min(FETCH_CONCURRENCY, len(shard.items)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fetch") as pool:
        for item in pool.map(preparer.prepare, shard.items):
            if item is None:
                prepared.skipped += 1
            else:
                prepared.items.append(item)
    return prepared


def unprepared_shard(shard: Shard, done: DoneIndex, questions: tuple[str, ...], error: BaseException) -> PreparedShard:
    """A shard whose prepare step failed as a whole (not an item's fetch or decode): each item with work
    left carries that failure, retryable, so the next run tries it again."""
    failure = ItemError("fetch", f"the shard failed: {type(error).__name__}: {error}", retryable=True)
    prepared = PreparedShard(shard)
    for item in shard.items:
        pending = done.pending_by_listing(item, item.questions or questions)
        if not pending:
            prepared.skipped += 1
            continue
        prepared.items.append(PreparedItem(item, pending, error=failure,
                                           members=[Member(key=m.key, size=m.size, etag=m.etag) for m in item.members]))
    return prepared
