"""The streamed listing: the first shard is handed over while the listing goes on, memory does
not grow with the number of listed objects (1,024 against 102,400 synthetic keys), and a listing
that fails part-way resumes after what it already handed over, without duplicates."""

from __future__ import annotations

import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest

import vlm_caption.tasks.sources.formats as formats
import vlm_caption.tasks.sources.listing as listing
from vlm_caption.tasks.sources.items import ObjectRef
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.listing import ShardStream


class SyntheticStorage:
    """A bucket of `count` keys, listed lazily; `gate` holds the listing after `hold_after` keys;
    `fail_at` raises once at that key (a page that failed past the client's retries)."""

    def __init__(self, count: int, hold_after: int | None = None, fail_at: int | None = None):
        self.count, self.hold_after, self.fail_at = count, hold_after, fail_at
        self.gate = threading.Event()

    def iter_objects(self, glob=None, prefix=""):
        for i in range(self.count):
            if i == self.hold_after:
                self.gate.wait(30)
            if i == self.fail_at:
                self.fail_at = None
                raise ConnectionError("connection reset while listing")
            yield ObjectRef(f"img/{i:07d}.jpg", 1000 + i, f"etag-{i}")


@pytest.fixture
def storage(monkeypatch):
    def use(store: SyntheticStorage) -> SyntheticStorage:
        monkeypatch.setattr(formats, "source_storage", lambda uri, follow_links=False: store)  # what SourceSpec.storage opens
        return store
    return use


def _stream(shard_size: int = 64, **kwargs) -> ShardStream:
    stream = ShardStream(SourceSpec("s3://synthetic/"), shard_size, None, **kwargs)
    threading.Thread(target=_quietly(stream.produce), daemon=True).start()  # what the list-source task runs
    return stream


def _quietly(produce):
    def run():
        try:
            produce()
        except ConnectionError:
            pass  # the consumer sees it; the thread need not print it too
    return run


def test_the_first_shard_comes_while_the_listing_goes_on(storage):
    store = storage(SyntheticStorage(100, hold_after=12))
    stream = _stream(shard_size=5)
    shards = iter(stream)
    first = next(shards)
    assert [item.id for item in first.items] == [f"img/{i:07d}.jpg" for i in range(5)]
    assert not stream.finished  # still listing (held at key 12)
    store.gate.set()
    rest = list(shards)
    assert stream.finished and [s.index for s in rest] == list(range(1, 20))


def test_limit_cuts_the_listing_into_shards_of_the_first_items(storage):
    storage(SyntheticStorage(100))
    stream = ShardStream(SourceSpec("s3://synthetic/"), 4, 10)
    threading.Thread(target=stream.produce, daemon=True).start()
    shards = list(stream)
    assert [(s.index, len(s.items)) for s in shards] == [(0, 4), (1, 4), (2, 2)]
    assert [item.id for s in shards for item in s.items] == [f"img/{i:07d}.jpg" for i in range(10)]


def _peak_while_consuming(count: int) -> int:
    store = SyntheticStorage(count)
    source_open = formats.source_storage
    formats.source_storage = lambda uri, follow_links=False: store
    try:
        tracemalloc.start()
        seen = sum(len(shard.items) for shard in _stream())
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        formats.source_storage = source_open
    assert seen == count
    return peak


def _peak_in_a_fresh_process(count: int) -> int:
    """tracemalloc counts every thread's allocations: measured in a process of its own, so the
    threads earlier tests left in this one (engines, Prefect's workers) cannot add to it."""
    code = f"from tests.test_listing_stream import _peak_while_consuming; print(_peak_while_consuming({count}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_memory_does_not_grow_with_the_listing():
    small, large = _peak_in_a_fresh_process(1_024), _peak_in_a_fresh_process(102_400)
    print(f"LISTING peak traced memory: 1,024 keys {small / 1024:.0f} KiB, 102,400 keys {large / 1024:.0f} KiB")
    assert large < small * 1.10 + 64 * 1024  # within 10% (plus allocator noise), not 100x


def test_a_failed_listing_resumes_without_duplicates(storage):
    storage(SyntheticStorage(300, fail_at=130))
    stream = _stream(shard_size=64)
    shards = list(stream)
    ids = [item.id for shard in shards for item in shard.items]
    assert ids == [f"img/{i:07d}.jpg" for i in range(300)]  # each once, in order
    assert [s.index for s in shards] == list(range(5))


def test_a_listing_that_keeps_failing_stops_the_run_with_its_error(storage, monkeypatch):
    class Broken(SyntheticStorage):
        def iter_objects(self, glob=None, prefix=""):
            yield ObjectRef("a.jpg", 1, "e")
            raise ConnectionError("endpoint unreachable")

    storage(Broken(0))
    monkeypatch.setattr(listing.time, "sleep", lambda s: None)
    with pytest.raises(ConnectionError, match="endpoint unreachable"):
        list(_stream(shard_size=64))


def test_a_consumer_that_stops_releases_the_listing(storage):
    storage(SyntheticStorage(10_000))
    stream = ShardStream(SourceSpec("s3://synthetic/"), 10, None, ahead=2)
    producer = threading.Thread(target=stream.produce)
    producer.start()
    next(iter(stream))
    stream.close()  # the run failed: the listing must not stay blocked on a full queue
    producer.join(10)
    assert not producer.is_alive()


def test_items_already_done_are_counted_not_sharded_and_the_rest_fill_whole_shards(storage):
    """A history of 10,000 items with one new item in every hundred: 100 items in two shards of
    64 and 36 (not a shard per new item), and 9,900 counted as already done, in listing order."""
    from vlm_caption.tasks.sources.listing import AlreadyDone

    storage(SyntheticStorage(10_000))
    new = lambda items: [int(item.id[4:11]) % 100 == 0 for item in items]  # noqa: E731
    stream = ShardStream(SourceSpec("s3://synthetic/"), 64, None, pending=new)
    threading.Thread(target=stream.produce, daemon=True).start()
    listed = list(stream)
    shards = [got for got in listed if not isinstance(got, AlreadyDone)]
    assert [(s.index, len(s.items)) for s in shards] == [(0, 64), (1, 36)]
    assert [item.id for s in shards for item in s.items] == [f"img/{i:07d}.jpg" for i in range(0, 10_000, 100)]
    assert sum(got.items for got in listed if isinstance(got, AlreadyDone)) == 9_900
    assert stream.items_listed == 10_000 and stream.already_done == 9_900


def test_done_items_are_judged_as_the_done_index_judges_each_one():
    """`DoneIndex.pending_mask` (a batch at once) says what `pending_by_listing` says item by item:
    done, changed since (another etag), a question not asked before, a re-run result, no etag."""
    from vlm_caption.tasks.results.done_index import DoneIndex
    from tests.result_files import index_rows
    from vlm_caption.tasks.records import ResultRecord
    from vlm_caption.tasks.sources.items import WorkItem

    def record(key, etag, question="q1"):
        return ResultRecord(key=key, size=10, etag=etag, sha256="s", recipe="r", model="m", question=question,
                            prompt=None, text="t", finish_reason="stop", timings={}, fingerprint="f", run_id="x")

    done = DoneIndex([index_rows([record("a", "e1"), record("b", "e1"), record("c", "e1"), record("c", "e2"),
                                  record("d", "e1", "q2")])])
    items = [WorkItem(key, (ObjectRef(key, 10, etag),)) for key, etag in
             (("a", "e1"), ("b", "e9"), ("c", "e2"), ("d", "e1"), ("e", "e1"), ("f", ""))]
    items.append(WorkItem("a", (ObjectRef("a", 10, "e1"),), questions=("q1", "q3")))
    expected = [bool(done.pending_by_listing(item, item.questions or ("q1",))) for item in items]
    assert expected == [False, True, False, True, True, True, True]
    assert list(done.pending_mask(items, ("q1",))) == expected


def test_a_listing_read_to_its_end_hands_on_its_greatest_key(storage):
    """`on_end`: once a listing without `limit` has read the source to its end (a failed page
    resumed), the greatest key it read, which a folder's walk does not read last; never for a
    listing cut by `limit` or one that failed (tasks/sources/watermark.py keeps it)."""
    class Walked(SyntheticStorage):  # a folder's walk: a folder's own files before its subfolders'
        def iter_objects(self, glob=None, prefix=""):
            yield from (ObjectRef(key, 1, "e") for key in ("z.jpg", "a/1.jpg", "a/2.jpg"))

    ends = []
    storage(SyntheticStorage(300, fail_at=130))
    assert len(list(_stream(on_end=ends.append))) == 5
    storage(Walked(0))
    list(_stream(on_end=ends.append))
    assert ends == ["img/0000299.jpg", "z.jpg"]
    limited = ShardStream(SourceSpec("s3://synthetic/"), 4, 10, on_end=ends.append)
    threading.Thread(target=limited.produce, daemon=True).start()
    assert len(list(limited)) == 1 and ends == ["img/0000299.jpg", "z.jpg"]
