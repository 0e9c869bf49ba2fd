"""How the shard pipeline schedules its work around the engine's start, with stand-in steps
(no engine, no Prefect API): while the engine builds, only the lookahead is prepared; then the
feed fills, a few shards at a time."""

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
from vlm_caption.tasks.engine.feed import FEED_ITEMS
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


def test_while_the_engine_builds_only_the_lookahead_is_prepared_then_the_feed_fills(stand_ins, monkeypatch):
    monkeypatch.setenv("VLM_CAPTION_FEED_MEDIA_BYTES", str(2 * 1024**3))
    get_settings.cache_clear()
    schedule = stand_ins(engine_start_s=1.0)  # ample for many quick prepares, had they been allowed
    _run(shards=48)
    # VLM_CAPTION_PREPARE_AHEAD (2) shards while it builds, not the feed's depth (32 shards).
    assert schedule.prepared_when_up == get_settings().prepare_ahead == 2
    assert schedule.most_at_once <= FEED_ITEMS // SHARD_SIZE  # then a few shards at a time
    assert sorted(schedule.generated) == list(range(48))  # every shard, once
