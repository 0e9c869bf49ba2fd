"""The end of one partition of a fanned-out run, after the shards it claimed from the plan: it
waits for the run's other claimed shards, captioning here those of a partition that is gone
(tasks/claims.py), then takes the plan's copy shards once every other shard is done, with the
done-index loaded again so that each copy finds its original's answer (tasks/shard_plan.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tasks.claims import ShardClaims
from tasks.results.done_index import DoneIndex
from tasks.shard_plan import SharedListing
from tasks.sources.items import Shard

if TYPE_CHECKING:  # the pipeline calls these: a type only, no import cycle
    from flows.pipeline import ShardPipeline

RETAKE_POLL_S = 2.0  # how often a partition that has run out of shards looks at the others' claims


def finish_partition(pipeline: ShardPipeline, claims: ShardClaims, plan: SharedListing,
                     listing: Callable[[DoneIndex, str], SharedListing], load_done: Callable[[], DoneIndex]) -> None:
    """`pipeline` has run the shards it claimed from `plan`; `listing(done, shards)` the run's
    plan read again; `load_done()` the done-index now."""
    retake_until_done(pipeline, claims, listing, load_done)
    if plan.copy_shards:
        retake_until_done(pipeline, claims, listing, load_done, until=plan.originals_done)
        pipeline.done = load_done()  # the originals' answers are on it now
        copies = listing(pipeline.done, "copies")
        try:
            pipeline.run(claims.claimed(copies))
        finally:
            copies.close()
        retake_until_done(pipeline, claims, listing, load_done)


def retake_until_done(pipeline: ShardPipeline, claims: ShardClaims, listing: Callable[[DoneIndex, str], SharedListing],
                      load_done: Callable[[], DoneIndex], until: Callable[[], bool] | None = None) -> None:
    """Until the run's claimed shards are done (and `until()` holds)."""
    while (retaken := claims.retake()) is not None or (until is not None and not until()):
        if retaken:  # a partition that is gone left these: captioned here; what it wrote before
            # it went (a part without its done mark) is on the done-index now.
            pipeline.done = load_done()
            again = listing(pipeline.done, "all")  # the run's plan, read again
            try:
                pipeline.run(shard for shard in again if isinstance(shard, Shard) and shard.index in retaken)
            finally:
                again.close()
        else:
            time.sleep(RETAKE_POLL_S)
