"""What a run shows of its shards: the counts (`RunStats`, for the manifest and summary), the
progress artifact and the terminal's bar (a shard at a time), a `vlm-caption.shard.failed` event,
and one Prefect task run per batch of consecutive shards, `caption-batch`, with one log line.

A batch's task run runs from its first shard's taking to its last shard's part being written,
returns the batch's counts and logs them (`batch done`, the run's one log line for its shards: a
night of a million new items leaves the server 45 of them, not a line per shard); a shard that
failed past its retries (flows/shard_steps.py) makes it Failed with that shard's error. Batches grow: 1 shard, then 2, 4, ... up to
`BATCH_ITEMS` items' worth (512 shards of 64), so a small run still shows several task runs and
a run of N items about N / BATCH_ITEMS of them (3,060 at 100M items in shards of 64): a graph
the UI can draw, at a pace Prefect's server records (docs/operations.md, "How many task runs a
run makes")."""

from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import wait as wait_all
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NONE

from vlm_caption.flows.partition_run import PartitionRun
from vlm_caption.tasks.errors import is_permanent
from vlm_caption.tasks.interrupt import part_written
from vlm_caption.tasks.observability import Progress, emit, get_logger
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.report import MAX_FAILURES_LISTED, RunStats
from vlm_caption.tasks.sources.items import Shard

BATCH_ITEMS = 32_768  # the most items a batch's shards hold (at least one shard)


def batch_size(number: int, shard_size: int) -> int:
    """Shards in a partition's `number`-th batch (from 1): doubling from 1 up to BATCH_ITEMS' worth."""
    return min(2 ** min(number - 1, 40), max(1, BATCH_ITEMS // shard_size))


@dataclass(frozen=True)
class ShardOutcome:
    """What became of one shard: its counts, its part, and the failure that fails its batch."""

    shard: int
    items: int = 0
    records: int = 0
    failed: int = 0
    part: str | None = None
    error: BaseException | None = None


class ShardFailed(RuntimeError):
    """A batch's shard failed past its retries (its items are error records, or its part was not written)."""


class Batch:
    """Consecutive shards of a partition, a slot each, resolved when the shard's part is written."""

    def __init__(self, number: int, size: int):
        self.number, self.size = number, size
        self.slots: list[Future] = []
        self.closed = threading.Event()  # no shard will join (full, or the listing ended)

    @property
    def full(self) -> bool:
        return len(self.slots) >= self.size

    def add(self) -> Future:
        slot = Future()
        self.slots.append(slot)
        if self.full:
            self.closed.set()
        return slot

    def outcomes(self) -> list[ShardOutcome]:
        """Once closed and every shard settled; the slots are let go (a batch's task run holds nothing)."""
        self.closed.wait()
        wait_all(self.slots)
        outcomes, self.slots = [slot.result() for slot in self.slots], []
        return outcomes


@task(name="caption-batch", task_run_name="caption-batch-{number}", cache_policy=NONE, persist_result=False)
def caption_batch(batch: Batch, number: int) -> dict[str, int]:
    """A batch of the run's shards as the UI shows it: running until its last shard's part is
    written; its counts (items, records, failed records, parts written); Failed with the first
    failed shard's error. The shards' work is not here (flows/shard_steps.py), only their end."""
    outcomes = batch.outcomes()
    counts = {"shards": len(outcomes), "items": sum(o.items for o in outcomes),
              "records": sum(o.records for o in outcomes), "failed": sum(o.failed for o in outcomes),
              "parts": sum(o.part is not None for o in outcomes)}
    get_logger().info("batch done", batch=number, first_shard=outcomes[0].shard, last_shard=outcomes[-1].shard,
                      **counts)
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        first = failed[0]
        raise ShardFailed(f"{len(failed)} of the batch's {len(outcomes)} shards failed; shard {first.shard}: "
                          f"{type(first.error).__name__}: {first.error}") from first.error
    return counts


def _settle(slot: Future, outcome: ShardOutcome) -> None:
    try:
        slot.set_result(outcome)
    except InvalidStateError:  # settled already, by the run's stop, as its write ended
        if outcome.part is not None:  # its batch said it failed; the part is there, and the next run skips it
            get_logger().warning("a shard's part was written after the run stopped", shard=outcome.shard,
                                 part=outcome.part)


class ShardReport:
    """A partition's shards as the run reports them (see the module's docstring)."""

    def __init__(self, run: PartitionRun):
        self.run = run
        self.stats = RunStats()
        self.progress = Progress(run.title)
        self.batch: Batch | None = None
        self.batches: list = []  # every batch's task run (its future), waited for at the end
        self.slots: dict[int, Future] = {}  # shards taken whose write is not yet submitted

    def take(self, shard: Shard) -> None:
        """A shard enters the pipeline: listed for the progress, and its batch's slot taken."""
        self.progress.grow(len(shard.items))
        if self.batch is None or self.batch.full:
            number = len(self.batches) + 1
            self.batch = Batch(number, batch_size(number, self.run.work.shard_size))
            self.batches.append(caption_batch.submit(self.batch, number))
        self.slots[shard.index] = self.batch.add()

    def skip(self, items: int) -> None:
        """Items the listing found already done: counted here, in no batch."""
        self.stats.add(items, items, [])
        self.progress.skip(items)

    def writing(self, shard: Shard, writing: Future, records: list[ResultRecord],
                failure: BaseException | None) -> None:
        """The shard's part is being written: its batch's slot settles when the write ends."""
        slot = self.slots.pop(shard.index)
        counts = {"items": len(shard.items), "records": len(records),
                  "failed": sum(1 for r in records if r.error)}

        def settle(done: Future) -> None:
            error, part = failure, None
            if done.cancelled():
                error = RuntimeError("the run stopped before the shard's part was written")
            elif done.exception() is not None:
                error = done.exception()  # nothing of the shard was written: that is what it tells
            else:
                part = done.result()
                if part is not None:  # what a run stopped by Ctrl-C says it kept (tasks/interrupt.py)
                    part_written(len({record.key for record in records}))
            _settle(slot, ShardOutcome(shard.index, **counts, part=part, error=error))

        writing.add_done_callback(settle)

    def shard_done(self, shard: Shard, skipped: int, records: list[ResultRecord]) -> None:
        """The shard's records counted and shown in the progress (its write under way; its batch's
        task run logs the counts)."""
        self.stats.add(len(shard.items), skipped, records)
        failed = sum(1 for r in records if r.error)
        self.progress.advance(len(shard.items), failed)
        if failed:  # the event an automation reacts to; a shard that went well is in the progress artifact
            emit("shard.failed", self.run.run_id, shard=shard.index, partition=self.run.index,
                 objects=len(shard.items), skipped=skipped, failed=failed)

    def collect(self, shard_index: int, writing: Future, records: list[ResultRecord]) -> None:
        """A write that ended: its part counted. A permanent failure (a full disk) stops the run;
        any other leaves the shard's records unwritten, counted as `write` failures (the next run
        computes them again: they are not on the done-index)."""
        try:
            part = writing.result()
        except Exception as exc:
            if is_permanent(exc):
                raise
            self.unwritten(shard_index, records, exc)
            return
        if part:
            self.stats.parts.append(part)

    def unwritten(self, shard_index: int, records: list[ResultRecord], exc: BaseException) -> None:
        stats, error = self.stats, f"{type(exc).__name__}: {exc}"
        for record in records:
            if record.error is None:
                stats.succeeded -= 1
            else:
                kind = record.error["kind"]
                stats.failures_by_kind[kind] -= 1
                if not stats.failures_by_kind[kind]:
                    del stats.failures_by_kind[kind]
            stats.failures_by_kind["write"] = stats.failures_by_kind.get("write", 0) + 1
            if len(stats.failures) < MAX_FAILURES_LISTED:
                stats.failures.append({"key": record.key, "question": record.question, "kind": "write",
                                       "message": error, "retryable": True})
        run = self.run
        run.log.warning("a shard's part was not written; the next run computes its items again",
                        shard=shard_index, records=len(records), error=error)
        emit("shard.failed", run.run_id, shard=shard_index, partition=run.index,
             failed=len(records), why="its part was not written")

    def end_batch(self) -> None:
        """No more shards join the open batch (the shards handed over have all been taken)."""
        if self.batch is not None:
            self.batch.closed.set()
            self.batch = None

    def stop(self, exc: BaseException) -> None:
        """The run stops: every shard taken and not written settles with `exc`, so every batch ends."""
        self.end_batch()
        for index, slot in self.slots.items():
            _settle(slot, ShardOutcome(index, error=exc))
        self.slots.clear()
        self.wait()

    def wait(self) -> None:
        """Every batch's task run has ended (its state is the server's before the run ends)."""
        for future in self.batches:
            future.wait()

    def close(self) -> None:
        self.end_batch()
        self.progress.close()
        self.wait()
