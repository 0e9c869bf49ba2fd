"""List the source and cut it into shards of work items, never loading object bytes; the items
come from the source format's reader (`tasks/sources/registry.py`)."""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Union

from prefect import task
from prefect.cache_policies import NONE

from vlm_caption.tasks.observability import get_logger, phase
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.items import Shard, WorkItem, as_text
from vlm_caption.tasks.sources.registry import open_reader
from vlm_caption.tasks.sources.watermark import changed_items


def iter_items(source: SourceSpec, read: Callable[[WorkItem], None] | None = None) -> Iterator[WorkItem]:
    """The source's items; with --modified-since only what changed (`read` sees every one)."""
    items = map(as_text, open_reader(source).items())  # a name that is not text: a bad_input item, not a crash
    if read is not None:
        items = (read(item) or item for item in items)
    return changed_items(items, source.changed) if source.changed is not None else items


@dataclass(frozen=True)
class AlreadyDone:
    """Items the listing found already done: counted, never made into a shard, task run or claim."""

    items: int


Listed = Union[Shard, AlreadyDone]  # what a listing hands over, in listing order
PendingMask = Callable[[list[WorkItem]], Sequence[bool]]  # which of a batch of items have work left

FILTER_BATCH = 1024  # items judged at once (DoneIndex.pending_mask); also how often done items are reported


class StreamClosed(Exception):
    """The consumer went away."""


class ShardStream:
    """The source's shards as the listing (the `list-source` task run) produces them, each handed
    over once full, at most `ahead` ahead of the captioning; with `pending`, done items are left
    out and counted (`AlreadyDone`). `begin()` lists before the flow run exists (flows/head_start.py);
    `on_end` gets the greatest item id a complete listing read (tasks/sources/watermark.py)."""

    ATTEMPTS = 3  # a listing that fails resumes after the items it already handed over

    def __init__(self, source: SourceSpec, shard_size: int, limit: int | None, ahead: int = 4,
                 pending: PendingMask | None = None, first_shard: int = 0, skip_items: int = 0,
                 on_end: Callable[[str | None], None] | None = None):
        self.source, self.shard_size, self.limit, self.pending = source, shard_size, limit, pending
        self.on_end, self.greatest_read = on_end, None
        self.items_listed = skip_items  # handed over (in shards or as done), or waiting in the next shard
        self.shards_listed = first_shard
        self.already_done = 0
        self.finished = False
        self._batch: list[WorkItem] = []
        self._unjudged: list[WorkItem] = []
        self._queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._closed = threading.Event()
        self._held_done = 0  # done items counted but not yet handed over (the queue was full)
        self._thread: threading.Thread | None = None  # the listing begun before the flow run
        self._error: BaseException | None = None  # how that listing ended, for its task run to raise

    def begin(self) -> ShardStream:
        self._thread = threading.Thread(target=self._produce_begun, name="vlm-caption-listing", daemon=True)
        self._thread.start()
        return self

    def _produce_begun(self) -> None:
        try:
            self.produce()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer by produce, raised by the task run
            self._error = exc

    def start(self) -> ShardStream:
        list_source.submit(self)
        return self

    def close(self) -> None:
        """The run stopped taking shards (it failed): let the listing task end, not block."""
        self._closed.set()

    def __iter__(self) -> Iterator[Listed]:
        for got in iter(self._queue.get, None):
            if isinstance(got, BaseException):
                raise got
            yield got

    def produce(self) -> None:
        """Every shard into the queue, then the end (or the error)."""
        phase("listing the source", source=self.source.uri)
        try:
            self._list_with_retries()
            self.finished = True
            if self.on_end is not None and self.limit is None:
                self.on_end(self.greatest_read)
            self.put(None)
        except StreamClosed:
            return
        except BaseException as exc:
            with contextlib.suppress(StreamClosed):
                self.put(exc)  # the run stops with the listing's own error
            raise

    def _list_with_retries(self) -> None:
        for attempt in range(1, self.ATTEMPTS + 1):
            try:
                return self._list_from(self.items_listed)
            except StreamClosed:
                raise
            except Exception as exc:  # noqa: BLE001 - a page that failed past the client's retries
                if attempt == self.ATTEMPTS:
                    raise
                self._unjudged = []  # listed again after the items already judged
                get_logger(source=self.source.uri).warning(
                    "listing failed; resuming after the items already listed", attempt=attempt,
                    items_listed=self.items_listed, error=str(exc))
                time.sleep(2 * attempt)

    def put(self, thing) -> None:
        """Waits for room while the captioning is behind (nothing is dropped), until the run closes.
        A count of done items that finds no room is added to the next thing handed over instead."""
        if self._closed.is_set():
            raise StreamClosed
        if isinstance(thing, AlreadyDone):
            self._held_done += thing.items
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(AlreadyDone(self._held_done))
                self._held_done = 0
            return
        if self._held_done:  # they came before `thing`
            held, self._held_done = self._held_done, 0
            self._put(AlreadyDone(held))
        self._put(thing)

    def _put(self, thing) -> None:
        while not self._closed.is_set():
            with contextlib.suppress(queue.Full):  # no room within 0.5 s: see whether closed, try again
                self._queue.put(thing, timeout=0.5)
                return
        raise StreamClosed

    def _list_from(self, skip: int) -> None:
        # After the `skip` items already handed over, up to `limit` (all with None).
        for item in itertools.islice(iter_items(self.source, self._read), skip, self.limit):
            if self.pending is None:
                self._take([item])
            else:
                self._unjudged.append(item)
                if len(self._unjudged) == FILTER_BATCH:
                    self._judge()
        if self._unjudged:
            self._judge()
        if self._batch:
            self._hand_over()

    def _read(self, item: WorkItem) -> None:
        if self.greatest_read is None or item.id > self.greatest_read:
            self.greatest_read = item.id

    def _judge(self) -> None:
        batch, self._unjudged = self._unjudged, []
        mask = self.pending(batch)
        done = len(batch) - int(sum(bool(m) for m in mask))
        self.items_listed += done
        if done:
            self.already_done += done
            self.put(AlreadyDone(done))
        self._take([item for item, left in zip(batch, mask) if left])

    def _take(self, items: list[WorkItem]) -> None:
        for item in items:
            self._batch.append(item)
            self.items_listed += 1
            if len(self._batch) == self.shard_size:
                self._hand_over()

    def _hand_over(self) -> None:
        shard = Shard(self.shards_listed, tuple(self._batch))
        self.shards_listed, self._batch = self.shards_listed + 1, []
        self.put(shard)


@task(name="list-source", cache_policy=NONE, persist_result=False)
def list_source(stream: ShardStream) -> dict:
    """Page through the source, cutting it into shards as it goes (or wait for the listing begun
    before the flow run, and raise its error)."""
    if stream._thread is not None:
        stream._thread.join()
        if stream._error is not None:
            raise stream._error
    else:
        stream.produce()
    counts = {"items": stream.items_listed, "shards": stream.shards_listed, "already_done": stream.already_done}
    get_logger(source=stream.source.uri).info("listed source", **counts)
    return counts
