"""List the source and cut it into shards of work items, never loading object bytes.

A folder or bucket gives one item per object (image, video) or per folder (multi-image groups);
a job manifest gives one item per line.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Iterable, Iterator

from prefect import task
from prefect.cache_policies import NONE

from tasks.observability import get_logger
from tasks.sources.formats import SourceSpec
from tasks.sources.groups import folder_groups
from tasks.sources.items import Shard, WorkItem
from tasks.sources.manifest import read_manifest
from tasks.sources.parquet_source import iter_parquet_items
from tasks.sources.webdataset import iter_webdataset_items


def iter_items(source: SourceSpec) -> Iterator[WorkItem]:
    if source.is_manifest:
        yield from read_manifest(source.storage, source.uri)
        return
    if source.format == "webdataset":
        yield from iter_webdataset_items(source.files, source.modality, source.glob, get_logger(source=source.uri))
        return
    if source.format == "parquet":
        yield from iter_parquet_items(source.files, source.column, source.glob, get_logger(source=source.uri))
        return
    objects = source.storage.iter_objects(source.glob)
    if source.modality == "multi-image":
        yield from folder_groups(objects)
        return
    for ref in objects:
        yield WorkItem(ref.key, (ref,))


def iter_shards(items: Iterable[WorkItem], shard_size: int) -> Iterator[Shard]:
    """Group a (lazy) sequence of items into shards of `shard_size`."""
    batch: list[WorkItem] = []
    index = 0
    for item in items:
        batch.append(item)
        if len(batch) == shard_size:
            yield Shard(index, tuple(batch))
            index, batch = index + 1, []
    if batch:
        yield Shard(index, tuple(batch))


def up_to(items: Iterable[WorkItem], limit: int | None) -> Iterator[WorkItem]:
    """The first `limit` items (all with None)."""
    return iter(items) if limit is None else itertools.islice(items, limit)


class _Closed(Exception):
    """The consumer went away."""


class ShardStream:
    """The source's shards as the listing produces them.

    A Prefect task (`list-source`) pages through the source in the background and hands over
    each shard as soon as it is full, at most `ahead` shards ahead of the captioning: the first
    shard starts while the listing goes on, and memory does not grow with the bucket. The
    partitions of a fan-out each list the same shards and claim them (tasks/claims.py)."""

    ATTEMPTS = 3  # a listing that fails resumes after the items it already handed over

    def __init__(self, source: SourceSpec, shard_size: int, limit: int | None, ahead: int = 4):
        self.source, self.shard_size, self.limit = source, shard_size, limit
        self.items_listed = 0  # handed over in shards, or waiting in the next one
        self.shards_listed = 0
        self.finished = False
        self._batch: list[WorkItem] = []
        self._queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._closed = threading.Event()

    def start(self) -> ShardStream:
        list_source.submit(self)
        return self

    def close(self) -> None:
        """The run stopped taking shards (it failed): let the listing task end, not block."""
        self._closed.set()

    def __iter__(self) -> Iterator[Shard]:
        while True:
            got = self._queue.get()
            if got is None:
                return
            if isinstance(got, BaseException):
                raise got
            yield got

    def produce(self) -> None:
        """Runs in the listing task: every shard into the queue, then the end (or the error)."""
        try:
            self._list_with_retries()
            self.finished = True
            self._put(None)
        except _Closed:
            return
        except BaseException as exc:
            with contextlib.suppress(_Closed):
                self._put(exc)  # the run stops with the listing's own error
            raise

    def _list_with_retries(self) -> None:
        for attempt in range(1, self.ATTEMPTS + 1):
            try:
                return self._list_from(self.items_listed)
            except _Closed:
                raise
            except Exception as exc:  # noqa: BLE001 - a page that failed past the client's retries
                if attempt == self.ATTEMPTS:
                    raise
                get_logger(source=self.source.uri).warning(
                    "listing failed; resuming after the items already listed", attempt=attempt,
                    items_listed=self.items_listed, error=str(exc))
                time.sleep(2 * attempt)

    def _put(self, thing) -> None:
        """Waits for room while the captioning is behind (nothing is dropped), until the run closes."""
        while not self._closed.is_set():
            with contextlib.suppress(queue.Full):  # no room within 0.5 s: see whether closed, try again
                self._queue.put(thing, timeout=0.5)
                return
        raise _Closed

    def _list_from(self, skip: int) -> None:
        items = up_to(iter_items(self.source), self.limit)
        for item in itertools.islice(items, skip, None):
            self._batch.append(item)
            self.items_listed += 1
            if len(self._batch) == self.shard_size:
                self._hand_over()
        if self._batch:
            self._hand_over()

    def _hand_over(self) -> None:
        self._put(Shard(self.shards_listed, tuple(self._batch)))
        self.shards_listed += 1
        self._batch = []


@task(name="list-source", cache_policy=NONE, persist_result=False)
def list_source(stream: ShardStream) -> dict:
    """Page through the source, cutting it into shards for the run as it goes."""
    stream.produce()
    counts = {"items": stream.items_listed, "shards": stream.shards_listed}
    get_logger(source=stream.source.uri).info("listed source", **counts)
    return counts
