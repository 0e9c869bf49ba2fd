"""A partition's shards in `caption-batch` task runs, one per batch of consecutive shards (1, doubling up
to BATCH_ITEMS' worth; docs/operations.md, "How many task runs a run makes"), each shard on a thread of its
own, a failed one tried again by the task's retries; the feed's schedule (flows/feed_schedule.py) bounds them."""

from __future__ import annotations

import contextvars
import queue
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prefect import task
from prefect.cache_policies import NONE
from prefect.utilities.annotations import quote

from vlm_caption.flows.feed_schedule import FeedSchedule, RunStopped, ShardReport
from vlm_caption.flows.plan import PartitionRun
from vlm_caption.tasks.claims import ShardClaims
from vlm_caption.tasks.engine.arguments import frame_resize_target, image_resize_target
from vlm_caption.tasks.engine.steps import GenerateOptions, failed_shard_records, generate_shard
from vlm_caption.tasks.errors import failure_of, is_permanent, retry_unless_permanent
from vlm_caption.tasks.interrupt import part_landing
from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.prepare import MediaOptions, PreparedShard, prepare_shard, unprepared_shard
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.done_index import DoneIndex
from vlm_caption.tasks.results.report import RunStats
from vlm_caption.tasks.results.writers import write_shard
from vlm_caption.tasks.sources.items import Shard, annotate_records
from vlm_caption.tasks.sources.listing import Listed

BATCH_ITEMS = 32_768  # the most items a batch's shards hold (at least one shard)
BATCH_RETRIES = 2  # a batch's failed shards are tried twice more, 2 s apart
# Threads are made as shards are taken and reused after; the schedule, not the pool, bounds how
# many work at once (a shard in the engine waits for its answers, so the feed's depth of them do).
MOST_THREADS = 4096


def batch_size(number: int, shard_size: int) -> int:
    """Shards in a partition's `number`-th batch (from 1): doubling from 1 up to BATCH_ITEMS' worth."""
    return min(2 ** min(number - 1, 40), max(1, BATCH_ITEMS // shard_size))


class ShardFailed(RuntimeError):
    """A batch's shard failed (tried again by the batch's retries while it has some left)."""


def _retry_batch(task, task_run, state) -> bool:
    """A batch is tried again unless its failure is permanent or the run stops."""
    return retry_unless_permanent(task, task_run, state) and not isinstance(failure_of(state), RunStopped)


@dataclass(eq=False)
class Batch:
    """Consecutive shards of a partition, handed to its task run as the listing yields them
    (`put`; None ends them); what became of each shard written (`settled`: its records and part)."""

    number: int
    size: int
    handed: int = 0
    shards: list[Shard] = field(default_factory=list)
    incoming: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    settled: dict[int, tuple[int, int, str | None]] = field(default_factory=dict)  # index: records, failed, part
    tries: int = 0

    def put(self, shard: Shard | None) -> None:
        self.handed += shard is not None
        self.incoming.put(shard)


@task(name="caption-batch", task_run_name="caption-batch-{number}", cache_policy=NONE, persist_result=False,
      retries=BATCH_RETRIES, retry_delay_seconds=2, retry_condition_fn=_retry_batch)
def caption_batch(pipeline: ShardPipeline, batch: Batch, number: int) -> dict[str, int]:
    """Prepare, generate and write a batch of the run's shards; its counts; Failed with the first
    failed shard's error."""
    return pipeline.caption(batch)


class ShardPipeline:
    """A partition's shards, done by batches: the listing's thread takes each shard once the feed's
    schedule has room and hands it to the open batch, whose task run gives each shard a thread."""

    def __init__(self, run: PartitionRun, done: DoneIndex, claims: ShardClaims | None = None):
        self.partition, self.done, self.claims = run, done, claims
        self.media = MediaOptions(run.modality, run.num_frames, run.image_limit, resize=image_resize_target(run.engine),
                                  frame_resize=frame_resize_target(run.engine), dedup=run.dedup)
        self.options = GenerateOptions(run.engine, run.sampling, run.method, run.num_frames, run.retry_looping,
                                       run.dedup)
        self.report = ShardReport(run)
        self.stats = self.report.stats
        self.schedule = FeedSchedule(run, self.report)
        self.generate_started: float | None = None
        self.threads = ThreadPoolExecutor(MOST_THREADS, thread_name_prefix="shard")
        self.batch: Batch | None = None
        self.batches: list = []  # every batch's task run (its future), waited for at the end

    def run(self, shards: Iterable[Listed]) -> None:
        """Caption `shards` (called again for shards retaken from a partition that is gone): each
        written, or recorded failed, by the time it returns. A failure that stops the run ends
        every batch first, so that every batch's task run ends."""
        listed = iter(shards)
        try:
            while (shard := self.schedule.take(listed)) is not None:
                if self.batch is None or self.batch.handed >= self.batch.size:
                    self.end_batch()
                    number = len(self.batches) + 1
                    self.batch = Batch(number, batch_size(number, self.partition.shard_size))
                    # quote(): the task run gets this very batch, not a copy Prefect rebuilt while looking for futures
                    self.batches.append(caption_batch.submit(self, quote(self.batch), number))
                self.batch.put(shard)
            self.end_batch()
            self.wait()
        except BaseException as exc:
            self.schedule.stop(exc)
            self.end_batch()
            self.wait()
            raise
        if self.schedule.stopping is not None:
            raise self.schedule.stopping  # a shard's permanent failure (a full disk)

    def end_batch(self) -> None:
        """No more shards join the open batch."""
        if self.batch is not None:
            self.batch.put(None)
            self.batch = None

    def wait(self) -> None:
        """Every batch's task run has ended (its state is the server's before the run ends)."""
        for future in self.batches:
            future.wait()

    def caption(self, batch: Batch) -> dict[str, int]:
        """A batch's task run (`caption_batch`): its shards, each on a thread of its own; on a
        retry, those not settled yet. On the last try a failed shard is settled with its items'
        error records."""
        batch.tries += 1
        last = batch.tries > BATCH_RETRIES
        if batch.tries == 1:
            shards = iter(batch.incoming.get, None)
        else:
            shards = [shard for shard in batch.shards if shard.index not in batch.settled]
            for _ in shards:
                self.schedule.retake()
        working = []
        for shard in shards:
            if batch.tries == 1:
                batch.shards.append(shard)
            working.append((shard, self.threads.submit(contextvars.copy_context().run, self.shard, batch, shard,
                                                       last)))
        failures = [(shard, error) for shard, error in ((s, w.result()) for s, w in working) if error]
        if self.schedule.stopping is not None:
            raise RunStopped(f"the run stopped: {type(self.schedule.stopping).__name__}: {self.schedule.stopping}")
        settled = batch.settled.values()
        counts = {"shards": len(batch.shards), "items": sum(len(s.items) for s in batch.shards),
                  "records": sum(r for r, _, _ in settled), "failed": sum(f for _, f, _ in settled),
                  "parts": sum(p is not None for _, _, p in settled)}
        if not failures or last:  # the batch's one log line: a night of a million new items leaves 45
            get_logger().info("batch done", batch=batch.number, first_shard=batch.shards[0].index,
                              last_shard=batch.shards[-1].index, **counts)
        if failures:
            shard, error = failures[0]
            raise ShardFailed(f"{len(failures)} of the batch's {len(batch.shards)} shards failed; shard "
                              f"{shard.index}: {type(error).__name__}: {error}") from error
        return counts

    def shard(self, batch: Batch, shard: Shard, last: bool) -> BaseException | None:
        """One shard prepared, asked and written (its part, then its claim marked done), then
        counted and settled in `batch`. Its failure is returned, the shard unsettled (the batch's
        retry does it again), except on the `last` try, where its items are settled as error records."""
        run = self.partition
        try:
            prepared, failure = self.prepare(shard, last)
            records = []
            if prepared.items:
                records, failed = self.generate(prepared, last)
                failure = failure or failed
            records = annotate_records(shard.items, records)  # a sample's or row's metadata
            if self.schedule.stopping is not None:
                return RunStopped("the run stopped")
            done_key = self.claims.done_key(shard.index) if self.claims is not None else None
            try:
                with part_landing(len({record.key for record in records})):  # what a Ctrl-C's end says it kept
                    part = write_shard(run.output, run.fingerprint, run.parts_id, shard.index, records, run.location,
                                       done_key)
            except Exception as exc:
                if is_permanent(exc) or not last:
                    raise
                self.report.unwritten(shard, prepared.skipped, records, exc)
                batch.settled[shard.index] = (len(records), len(records), None)
                return exc
            failed_records = self.report.shard_done(shard, prepared.skipped, records, part)
            batch.settled[shard.index] = (len(records), failed_records, part)
            return failure
        except Exception as exc:
            if is_permanent(exc):
                self.schedule.stop(exc)
            run.log.warning("a shard failed" + ("" if last else "; its batch tries it again"), shard=shard.index,
                            error=f"{type(exc).__name__}: {exc}")
            return exc

    def prepare(self, shard: Shard, last: bool) -> tuple[PreparedShard, BaseException | None]:
        """The shard fetched and decoded; one whose prepare failed as a whole comes back, on the
        last try, with its items carrying the failure (returned beside it)."""
        prepared, failure = None, None
        try:
            prepared = prepare_shard(self.partition.source, shard, self.done, self.partition.questions, self.media)
        except Exception as exc:
            if is_permanent(exc) or not last:
                raise
            prepared, failure = unprepared_shard(shard, self.done, self.partition.questions, exc), exc
        finally:
            self.schedule.prepared(prepared)
        return prepared, failure

    def generate(self, prepared: PreparedShard, last: bool) -> tuple[list[ResultRecord], BaseException | None]:
        """The shard's records, from the engine once the feed has room; on the last try its
        failure makes them (`failed_shard_records`)."""
        with self.schedule.in_engine() as engine:
            self.generate_started = self.generate_started or time.time()
            try:
                records = generate_shard(prepared, self.options, self.partition.fingerprint, self.partition.parts_id)
            except Exception as exc:
                if is_permanent(exc) or not last:
                    raise
                return failed_shard_records(prepared, exc, engine["model"], self.options, self.partition.fingerprint,
                                            self.partition.parts_id), exc
        self.stats.mark_result()
        return records, None

    def close(self) -> tuple[RunStats, dict | None]:
        schedule, stats = self.schedule, self.stats
        if schedule.engine is None and schedule.starting is not None:
            schedule.engine = schedule.starting.result()  # started for items that turned out done by content
        if self.generate_started is not None:
            stats.mark_generating(self.generate_started, time.time())  # first request to last result
        self.report.progress.close()
        self.threads.shutdown(wait=False)
        return stats, schedule.engine
