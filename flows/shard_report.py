"""What a run shows of its shards as they end (flows/pipeline.py does them): the counts
(`RunStats`, for the manifest and summary), the progress artifact and the terminal's bar, and a
`vlm-caption.shard.failed` event for a shard with failed items. Its methods are called from the
shards' threads, so each holds one lock."""

from __future__ import annotations

import threading

from vlm_caption.flows.partition_run import PartitionRun
from vlm_caption.tasks.interrupt import part_written
from vlm_caption.tasks.observability import Progress, emit
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.report import MAX_FAILURES_LISTED, RunStats
from vlm_caption.tasks.sources.items import Shard


class ShardReport:
    """A partition's shards as the run reports them (see the module's docstring)."""

    def __init__(self, run: PartitionRun):
        self.run = run
        self.stats = RunStats()
        self.progress = Progress(run.title)
        self.lock = threading.Lock()

    def take(self, shard: Shard) -> None:
        """A shard enters the pipeline: its items join the progress's total."""
        with self.lock:
            self.progress.grow(len(shard.items))

    def skip(self, items: int) -> None:
        """Items the listing found already done: counted here, in no batch."""
        with self.lock:
            self.stats.add(items, items, [])
            self.progress.skip(items)

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
        if part is not None:  # what a run stopped by Ctrl-C says it kept (tasks/interrupt.py)
            part_written(len({record.key for record in records}))
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

    def close(self) -> None:
        self.progress.close()
