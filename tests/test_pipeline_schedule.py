"""How the shard pipeline schedules its work around the engine's start, with stand-in steps
(no engine, no Prefect API): while the engine starts, the feed's whole depth of shards is
prepared, a few shards at a time and no more than their decoded bytes allow."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from PIL import Image

import vlm_caption.flows.batches as batches
import vlm_caption.flows.feed_schedule as feed_schedule
from vlm_caption.flows.batches import ShardPipeline
from vlm_caption.flows.params import CaptionJob
from vlm_caption.flows.plan import PartitionRun, RunPlan, engine_spec
from vlm_caption.recipes import get_recipe
from vlm_caption.tasks.engine.feed import FEED_REQUESTS
from vlm_caption.tasks.prepare import PreparedItem, PreparedShard
from vlm_caption.tasks.results.done_index import DoneIndex
from vlm_caption.tasks.settings import get_settings
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.items import ObjectRef, Shard, WorkItem

SHARD_SIZE = 64
CROP = Image.new("RGB", (336, 336))  # 338,688 bytes decoded: 64 of them are 21.7 MB


def _unwrap(value):
    return value.unwrap() if hasattr(value, "unwrap") else value


class StandInTask:
    """`task.submit(...)` on a thread pool, the arguments unwrapped as Prefect would; its future
    has Prefect's `wait()`."""

    def __init__(self, pool: ThreadPoolExecutor, fn):
        self.pool, self.fn = pool, fn

    def submit(self, *args, **kwargs) -> Future:
        future = self.pool.submit(self.fn, *map(_unwrap, args), **kwargs)
        future.wait = future.exception  # until it ends, raising nothing
        return future


class Schedule:
    """What the stand-in tasks saw: shards prepared at once, and how many were prepared by
    the time the engine came up."""

    def __init__(self, engine_start_s: float):
        self.engine_start_s = engine_start_s
        self.lock = threading.Lock()
        self.preparing = self.most_at_once = self.prepared = 0
        self.prepared_when_up: int | None = None
        self.generated: list[int] = []

    def prepare(self, source, shard: Shard, done, questions, options) -> PreparedShard:
        with self.lock:
            self.preparing += 1
            self.most_at_once = max(self.most_at_once, self.preparing)
        time.sleep(0.01)
        with self.lock:
            self.preparing -= 1
            self.prepared += 1
        return PreparedShard(shard, [PreparedItem(item, questions, media=CROP) for item in shard.items])

    def start_engine(self, spec) -> dict:
        time.sleep(self.engine_start_s)
        with self.lock:
            self.prepared_when_up = self.prepared
        return {"model": "llava", "sizing": {"max_num_seqs": 1024}, "ready_at": time.time(),
                "startup_s": self.engine_start_s}

    def generate(self, prepared: PreparedShard, options, fingerprint, parts_id) -> list:
        self.generated.append(prepared.shard.index)
        return []


class SilentProgress:
    def __init__(self, description):
        pass

    def grow(self, items):
        pass

    def skip(self, items):
        pass

    def advance(self, items=0, errors=0):
        return 0.0

    def close(self):
        pass


class SilentLog:
    def info(self, *args, **kwargs):
        pass

    def warning(self, *args, **kwargs):
        raise AssertionError(f"no shard fails here: {args} {kwargs}")


@pytest.fixture
def stand_ins(monkeypatch):
    def install(engine_start_s: float) -> Schedule:
        schedule = Schedule(engine_start_s)
        pool = ThreadPoolExecutor(max_workers=64)
        monkeypatch.setattr(batches, "prepare_shard", schedule.prepare)
        monkeypatch.setattr(feed_schedule, "start_engine", StandInTask(pool, schedule.start_engine))
        monkeypatch.setattr(batches, "generate_shard", schedule.generate)
        monkeypatch.setattr(batches, "write_shard", lambda *args: None)
        monkeypatch.setattr(batches, "caption_batch", StandInTask(pool, batches.caption_batch.fn))
        monkeypatch.setattr(batches, "get_logger", lambda: SilentLog())
        monkeypatch.setattr(feed_schedule, "emit", lambda *args, **kwargs: None)
        monkeypatch.setattr(feed_schedule, "ensure_vllm_imported", lambda: None)
        monkeypatch.setattr(feed_schedule, "start_decode_pool", lambda modality: None)
        monkeypatch.setattr(feed_schedule, "Progress", SilentProgress)
        monkeypatch.setattr(batches, "image_resize_target", lambda spec: None)
        return schedule

    monkeypatch.delenv("VLM_CAPTION_FEED_DEPTH", raising=False)
    monkeypatch.delenv("VLM_CAPTION_PREPARE_AHEAD", raising=False)
    yield install
    get_settings.cache_clear()


def _run(shards: int) -> None:
    job = CaptionJob(source="/nowhere", output="/nowhere-out", recipe="llava", shard_size=SHARD_SIZE,
                     source_format="files")  # as the plan resolves it
    plan = RunPlan(job=job, recipe=get_recipe("llava"), model="llava", fingerprint="fingerprint",
                   source=SourceSpec(job.source, "image", format="files"), output=None, engine=engine_spec(job))
    run = PartitionRun.of(plan, "run", None, SilentLog())
    listing = [Shard(i, tuple(WorkItem(f"{i}/{n}.jpg", (ObjectRef(f"{i}/{n}.jpg", 1, ""),))
                              for n in range(SHARD_SIZE))) for i in range(shards)]
    pipeline = ShardPipeline(run, DoneIndex())
    pipeline.run(listing)
    stats, _ = pipeline.close()
    assert stats.listed == shards * SHARD_SIZE


def test_the_feeds_whole_depth_is_prepared_while_the_engine_starts(stand_ins, monkeypatch):
    monkeypatch.setenv("VLM_CAPTION_FEED_MEDIA_BYTES", str(2 * 1024**3))
    get_settings.cache_clear()
    schedule = stand_ins(engine_start_s=3.0)  # ample for 32 quick prepares on a busy machine
    _run(shards=48)
    depth = FEED_REQUESTS // SHARD_SIZE  # 32 shards: 2,048 requests of 21.7 MB crops fit in 2 GiB
    # All of it by the time the engine is up (before: 8 shards, FEED_ITEMS), not the whole listing.
    assert depth <= schedule.prepared_when_up <= depth + 2 < 48
    assert schedule.most_at_once <= 512 // SHARD_SIZE  # a few shards at a time (FEED_ITEMS)
    assert sorted(schedule.generated) == list(range(48))  # every shard, once


def test_what_is_prepared_while_the_engine_starts_is_bounded_by_decoded_bytes(stand_ins, monkeypatch):
    shard_bytes = SHARD_SIZE * 336 * 336 * 3
    monkeypatch.setenv("VLM_CAPTION_FEED_MEDIA_BYTES", str(12 * shard_bytes))
    get_settings.cache_clear()
    schedule = stand_ins(engine_start_s=2.0)
    _run(shards=20)
    # The first 8 shards (FEED_ITEMS) go out before any shard's bytes are known; then the depth
    # the bytes allow, 12, not 32.
    assert 12 <= schedule.prepared_when_up <= 12 + 2
    assert sorted(schedule.generated) == list(range(20))

