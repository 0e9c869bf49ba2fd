"""The feed's schedule over one partition's shards (flows/batches.py does them): how many are taken
and prepared ahead of the engine and how many are in it (docs/architecture.md, "How the GPU is kept
busy"; the depth: tasks/engine/feed.py); and what the run shows of its shards (`ShardReport`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

from vlm_caption.flows.plan import PartitionRun
from vlm_caption.tasks.engine.feed import FEED_ITEMS, feed_depth, shards_holding
from vlm_caption.tasks.engine.steps import start_engine
from vlm_caption.tasks.engine.vllm_import import ensure_vllm_imported
from vlm_caption.tasks.media.pool import start_decode_pool
from vlm_caption.tasks.observability import Progress, emit
from vlm_caption.tasks.prepare import PreparedShard
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.report import MAX_FAILURES_LISTED, RunStats
from vlm_caption.tasks.settings import get_settings
from vlm_caption.tasks.sources.items import Shard
from vlm_caption.tasks.sources.listing import AlreadyDone, Listed


class ShardReport:
    """A partition's shards as the run reports them: the counts (`RunStats`), the progress, and a
    `vlm-caption.shard.failed` event for a shard with failed items; called from the shards' threads."""

    def __init__(self, run: PartitionRun):
        self.run = run
        self.stats = RunStats()
        self.progress = Progress(run.title)
        self.lock = threading.Lock()

    def listed(self, item: Listed) -> None:
        """Items the listing found already done (counted here, in no batch), or a shard entering
        the pipeline (its items join the progress's total)."""
        with self.lock:
            if isinstance(item, AlreadyDone):
                self.stats.add(item.items, item.items, [])
                self.progress.skip(item.items)
            else:
                self.progress.grow(len(item.items))

    def shard_done(self, shard: Shard, skipped: int, records: list[ResultRecord], part: str | None,
                   failed: int | None = None) -> int:
        """The shard's part written (`part`; None: nothing to write): its records counted and
        shown in the progress (`failed`: its failures, if not its records'). Returns its failures."""
        failed = sum(1 for r in records if r.error) if failed is None else failed
        with self.lock:
            self.stats.add(len(shard.items), skipped, records)
            if part is not None:
                self.stats.parts.append(part)
            self.progress.advance(len(shard.items), failed)
        if failed:  # the event an automation reacts to; a shard that went well is in the progress artifact
            emit("shard.failed", self.run.run_id, shard=shard.index, partition=self.run.index,
                 objects=len(shard.items), skipped=skipped, failed=failed)
        return failed

    def unwritten(self, shard: Shard, skipped: int, records: list[ResultRecord], exc: BaseException) -> None:
        """A shard whose part could not be written past its batch's retries: its records counted
        as `write` failures, in the progress and its `shard.failed` event too (the next run computes
        them again: they are not on the done-index)."""
        self.shard_done(shard, skipped, [], None, failed=len(records))
        error = f"{type(exc).__name__}: {exc}"
        with self.lock:
            stats = self.stats
            stats.processed += len(records)
            stats.failures_by_kind["write"] = stats.failures_by_kind.get("write", 0) + len(records)
            for record in records[:max(0, MAX_FAILURES_LISTED - len(stats.failures))]:
                stats.failures.append({"key": record.key, "question": record.question, "kind": "write",
                                       "message": error, "retryable": True})
        self.run.log.warning("a shard's part was not written; the next run computes its items again",
                             shard=shard.index, records=len(records), error=error)


class RunStopped(RuntimeError):
    """The run stopped (Ctrl-C, a permanent failure): no shard goes further."""


class FeedSchedule:
    """Shards taken and not yet in the engine (`ahead`, of which `preparing` are being fetched
    and decoded) and in the engine (`in_flight`), under one condition that every change notifies."""

    def __init__(self, run: PartitionRun, report: ShardReport):
        self.run, self.report = run, report
        self.lookahead = max(1, get_settings().prepare_ahead)
        self.filling = max(self.lookahead, shards_holding(FEED_ITEMS, run.shard_size, len(run.questions)))
        self.media_bytes, self.prepared_shards = 0, 0  # decoded media seen, to size the feed in bytes
        self.room = threading.Condition()
        self.ahead = self.preparing = self.in_flight = 0
        self.stopping: BaseException | None = None  # why the run stops
        self.starting = None  # the engine's start, submitted at the first shard taken
        self.engine: dict | None = None
        self.engine_lock = threading.Lock()
        self.engine_up = threading.Event()  # the engine's start ended (built, or failed)

    def take(self, listed: Iterable[Listed]) -> Shard | None:
        """The listing's next shard, once there is room to prepare it (None: the listing ended,
        or the run stops); items already done that the listing hands over are counted. The
        engine starts at the first shard (a run with nothing new starts no engine or decode pool)."""
        with self.room:
            self.room.wait_for(lambda: self.stopping is not None or self.may_prepare())
        if self.stopping is not None:
            return None
        for item in listed:
            self.report.listed(item)
            if isinstance(item, AlreadyDone):
                continue
            self.start_engine()
            self.retake()
            return item
        return None

    def retake(self) -> None:
        """A shard taken (again, by its batch's retry): ahead of the engine, being prepared."""
        with self.room:
            self.ahead += 1
            self.preparing += 1

    def may_prepare(self) -> bool:
        """While the engine builds, `lookahead` shards: the build has the host's cores (on one H200 a
        7B engine built in 20 s, against 26 s beside the feed's whole depth being decoded, and the run
        generated no slower: docs/benchmarks.md). Once it is up, the feed's depth."""
        ahead = self.ahead
        return ahead < self.lookahead or (self.engine_up.is_set() and ahead + self.in_flight <= self.depth
                                          and self.preparing < self.filling)

    @property
    def depth(self) -> int:
        """Shards in the engine at once (tasks/engine/feed.py)."""
        run, sizing = self.run, self.engine["sizing"] if self.engine else None
        mean_bytes = self.media_bytes / self.prepared_shards if self.prepared_shards else None
        return feed_depth(run.modality, run.shard_size, len(run.questions), sizing, mean_bytes,
                          shared=run.partition is not None, request_tokens=self.report.stats.tokens_per_request())

    def start_engine(self) -> None:
        """The engine's start submitted once; the decode pool starts beside it."""
        if self.starting is None:
            ensure_vllm_imported()  # made by the flow's thread (tasks/engine/vllm_import.py), if not yet
            self.starting = start_engine.submit(self.run.engine)
            self.starting.add_done_callback(lambda _: self.engine_up.set())
            start_decode_pool(self.run.modality)

    def prepared(self, prepared: PreparedShard | None) -> None:
        """A shard's prepare ended (None: it failed); one with nothing to ask leaves the feed."""
        with self.room:
            self.preparing -= 1
            if prepared is not None and prepared.items:
                self.media_bytes += prepared.media_bytes
                self.prepared_shards += 1
            else:
                self.ahead -= 1
            self.room.notify_all()

    @contextlib.contextmanager
    def in_engine(self) -> Iterator[dict]:
        """A prepared shard in the engine (yields it) once the engine is up and the feed has room."""
        try:
            engine = self.await_engine()
            with self.room:
                self.room.wait_for(lambda: self.stopping is not None or self.in_flight <= self.depth)
                if self.stopping is not None:
                    raise RunStopped("the run stopped")
                self.in_flight += 1
        finally:
            with self.room:
                self.ahead -= 1
                self.room.notify_all()
        try:
            yield engine
        finally:
            with self.room:
                self.in_flight -= 1
                self.room.notify_all()

    def await_engine(self) -> dict:
        """The engine, once up (every shard waiting is told: the feed's depth follows its batch)."""
        while not self.engine_up.wait(1.0):  # looked at each second: a run that stops leaves at once
            if self.stopping is not None:
                raise RunStopped("the run stopped")
        with self.engine_lock:
            if self.engine is None:
                self.engine = self.starting.result()
                with self.room:
                    self.room.notify_all()
            return self.engine

    def stop(self, exc: BaseException) -> None:
        """No shard goes further: the listing stops taking, the shards waiting leave."""
        with self.room:
            self.stopping = self.stopping or exc
            self.room.notify_all()
