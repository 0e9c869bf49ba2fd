"""One partition's shards, in this process: the done-index loaded and the source listed (streamed)
into shards of the items with work left, which flows/batches.py captions."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterable

from vlm_caption.flows.batches import ShardPipeline
from vlm_caption.flows.head_start import take_head_start
from vlm_caption.flows.plan import PartitionRun
from vlm_caption.tasks.claims import ShardClaims
from vlm_caption.tasks.results.done_index import DoneIndex, load_done_index
from vlm_caption.tasks.results.report import RunStats
from vlm_caption.tasks.shard_plan import SharedListing
from vlm_caption.tasks.sources.items import Shard
from vlm_caption.tasks.sources.listing import Listed, ShardStream
from vlm_caption.tasks.sources.watermark import keep_listing_end

RETAKE_POLL_S = 2.0  # how often a partition that has run out of shards looks at the others' claims


def caption_shards(run: PartitionRun) -> tuple[RunStats, dict | None, dict | None]:
    """Caption this run's items shard by shard as the listing streams them in (a partition of a
    fanned-out run: those it claims, then `finish_partition`). Returns the counts, the engine,
    and the claims' figures."""
    part = run.partition
    claims = ShardClaims(run.output, run.run_id, part.index, partitions=part.count) if part else None
    with claims or contextlib.nullcontext():
        started = take_head_start() if claims is None else None  # a nightly run's, begun before its flow
        done = started[0] if started else load_done_index(run.output, run.fingerprint)
        stream = started[1] if started else listing(run, done, claims)
        try:
            pipeline = ShardPipeline(run, done, claims)
            run.log.info("run started", source=run.source.uri, output=run.output.uri, modality=run.modality,
                         questions=len(run.questions), already_done=len(done), partition=run.parts_id)
            pipeline.run(claims.claimed(stream) if claims else stream)
        finally:
            stream.close()
        if claims is None:
            return (*pipeline.close(), None)
        finish_partition(pipeline, run, claims, stream)  # the others' claimed shards, a gone one's, the copies
        return (*pipeline.close(), {"shards": claims.taken, "retaken": claims.retaken})


def finish_partition(pipeline: ShardPipeline, run: PartitionRun, claims: ShardClaims, plan: SharedListing) -> None:
    """After the shards it claimed from `plan`, a partition waits for the run's other claimed shards,
    captioning here those of a partition that is gone (tasks/claims.py), then takes the plan's copy
    shards once every other shard is done, the done-index loaded again (tasks/shard_plan.py)."""
    def again(shards: str, pick: Callable[[Iterable[Listed]], Iterable[Listed]]) -> None:
        pipeline.done = load_done_index(run.output, run.fingerprint)  # with what was written since
        plan_again = listing(run, pipeline.done, claims, shards)  # the run's plan, read again
        try:
            pipeline.run(pick(plan_again))
        finally:
            plan_again.close()

    def retake_until_done(until: Callable[[], bool] = lambda: True) -> None:
        while (retaken := claims.retake()) is not None or not until():
            if retaken:  # a gone partition's, captioned here (what it wrote before it went is on the done-index)
                again("all", lambda shards: (s for s in shards if isinstance(s, Shard) and s.index in retaken))
            else:
                time.sleep(RETAKE_POLL_S)

    retake_until_done()
    if plan.copy_shards:
        retake_until_done(plan.originals_done)
        again("copies", claims.claimed)  # the originals' answers are on the done-index now
        retake_until_done()


def listing(run: PartitionRun, done: DoneIndex, claims: ShardClaims | None,
            shards: str = "originals") -> ShardStream | SharedListing:
    """The source's shards with work left, streamed, and between them the count of items already
    done (`AlreadyDone`: no task run, claim or engine for them). A fanned-out run lists once, into
    a shard plan every partition reads (tasks/shard_plan.py)."""
    pending = lambda items: done.pending_mask(items, run.questions)  # noqa: E731
    ended = functools.partial(keep_listing_end, run.output, run.source, run.fingerprint)  # the greatest key, at its end
    if claims is None:
        return ShardStream(run.source, run.shard_size, run.limit, pending=pending, on_end=ended).start()
    return SharedListing(run.output, run.run_id, claims, run.source, run.shard_size, run.limit,
                         pending, shards=shards, on_end=ended, dedup=run.dedup).start()
