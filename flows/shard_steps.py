"""A shard's steps (prepare, generate, write) as plain functions on this process's threads, for
the pipeline's schedule (flows/pipeline.py), which bounds how many of each run at once.

They are not Prefect task runs: three per shard made millions for a run of 100M items, more
than Prefect's server records (its event queues drop state changes under such a burst) or its
UI can show. Prefect sees the shards a batch at a time instead (flows/shard_report.py). Each
step runs in a copy of the flow run's context, so its log lines still reach the flow run's logs.

What Prefect's task retries did, each step's function does itself (tasks/retries.py): generate
once more (an engine that died is replaced), write three more times. A shard whose step fails
past that is not the end of the run: its items become error records, retryable (the part says
what became of each, and the next run computes them again), and its batch ends Failed. A
permanent failure (a full disk) is raised: the run stops, as every later shard would fail too."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vlm_caption.tasks.engine.steps import GenerateOptions, failed_shard_records, generate_shard
from vlm_caption.tasks.errors import is_permanent
from vlm_caption.tasks.prepare import MediaOptions, PreparedShard, prepare_shard, unprepared_shard
from vlm_caption.tasks.results.done_index import DoneIndex
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.writers import write_shard
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.items import Shard
from vlm_caption.tasks.sources.storage import Storage

# Threads are made as steps are submitted and reused after; the schedule, not the pool, bounds
# how many run at once (a generate step waits on the engine, so the feed's depth of them do).
MOST_THREADS = 4096


class ShardSteps:
    """The steps of one partition's shards: where they run, and what a shard's failure becomes."""

    def __init__(self, source: SourceSpec, output: Storage, questions: tuple[str, ...], media: MediaOptions,
                 options: GenerateOptions, fingerprint: str, parts_id: str, log: Any):
        self.source, self.output, self.questions, self.media = source, output, questions, media
        self.options, self.fingerprint, self.parts_id, self.log = options, fingerprint, parts_id, log
        self.pools = {step: ThreadPoolExecutor(MOST_THREADS, thread_name_prefix=step)
                      for step in ("prepare", "generate", "write")}

    def _submit(self, step: str, call: Callable[[], Any]) -> Future:
        return self.pools[step].submit(contextvars.copy_context().run, call)

    def prepare(self, shard: Shard, done: DoneIndex) -> Future:
        """Future of `(PreparedShard, failure)`: a shard whose prepare failed as a whole comes
        back with its items carrying the failure."""
        def step() -> tuple[PreparedShard, BaseException | None]:
            try:
                return prepare_shard(self.source, shard, done, self.questions, self.media), None
            except Exception as exc:
                if is_permanent(exc):
                    raise
                self._failed("prepare", shard.index, exc)
                return unprepared_shard(shard, done, self.questions, exc), exc
        return self._submit("prepare", step)

    def generate(self, prepared: PreparedShard, model: str) -> Future:
        """Future of `(records, failure)`: every (item, question) of the shard asked of the
        engine; past its retry, the shard's records carry the failure."""
        def step() -> tuple[list[ResultRecord], BaseException | None]:
            try:
                return generate_shard(prepared, self.options, self.fingerprint, self.parts_id), None
            except Exception as exc:
                if is_permanent(exc):
                    raise
                self._failed("generate", prepared.shard.index, exc)
                return failed_shard_records(prepared, exc, model, self.options, self.fingerprint,
                                            self.parts_id), exc
        return self._submit("generate", step)

    def write(self, shard_index: int, records: list[ResultRecord], done_key: str | None) -> Future:
        """Future of the part written (None: nothing to write); raises what failed past the retries."""
        return self._submit("write", lambda: write_shard(self.output, self.fingerprint, self.parts_id, shard_index,
                                                         records, done_key))

    def _failed(self, step: str, shard: int, exc: BaseException) -> None:
        self.log.warning("a shard failed past its retries; its items are recorded with the error and its batch "
                         "fails", step=step, shard=shard, error=f"{type(exc).__name__}: {exc}")

    def shutdown(self) -> None:
        """No new step: steps not started are dropped (a run that stops); the writes under way
        are waited for, so that no part is left being written."""
        for step, pool in self.pools.items():
            pool.shutdown(wait=step == "write", cancel_futures=True)
