"""The pipeline over one partition's shards, in this process: listed (streamed) into shards of
the items with work left, each fetched and decoded ahead, its requests fed to the engine while
other shards' are still in it, its part written as soon as its last request finishes.
`flows/caption.py` runs it for its own partition and for any child partition it takes over."""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from vlm_caption.flows.head_start import take_head_start
from vlm_caption.flows.partition_run import PartitionRun
from vlm_caption.flows.shard_report import ShardReport
from vlm_caption.flows.shard_steps import ShardSteps
from vlm_caption.tasks.engine.arguments import EngineSpec, frame_resize_target, image_resize_target
from vlm_caption.tasks.engine.feed import FEED_ITEMS, feed_depth, shards_holding
from vlm_caption.tasks.engine.steps import GenerateOptions, start_engine
from vlm_caption.tasks.claims import ShardClaims
from vlm_caption.tasks.engine.vllm_import import ensure_vllm_imported
from vlm_caption.tasks.media.pool import start_decode_pool
from vlm_caption.tasks.prepare import MediaOptions
from vlm_caption.tasks.results.done_index import DoneIndex, load_done_index
from vlm_caption.tasks.results.report import RunStats
from vlm_caption.tasks.settings import get_settings
from vlm_caption.tasks.sources.extras import annotate_records
from vlm_caption.tasks.shard_plan import SharedListing
from vlm_caption.tasks.sources.items import Shard
from vlm_caption.tasks.sources.listing import AlreadyDone, Listed, ShardStream
from vlm_caption.tasks.sources.listing_end import keep_listing_end

RETAKE_POLL_S = 2.0  # how often a partition that has run out of shards looks at the others' claims


def caption_shards(run: PartitionRun) -> tuple[RunStats, dict | None, dict | None]:
    """Caption this run's items shard by shard as the listing streams them in. A partition of a
    fanned-out run takes the shards it claims (tasks/claims.py), then waits for the run's other
    claimed shards, retaking those of a partition that is gone. Returns the counts, the engine,
    and the claims' figures."""
    if run.partition is None:
        stats, engine = _caption(run, None)
        return stats, engine, None
    with ShardClaims(run.output, run.run_id, run.partition.index, partitions=run.partition.count) as claims:
        stats, engine = _caption(run, claims)
        return stats, engine, {"shards": claims.taken, "retaken": claims.retaken}


def _caption(run: PartitionRun, claims: ShardClaims | None) -> tuple[RunStats, dict | None]:
    work = run.work
    started = take_head_start(run) if claims is None else None  # a nightly run's, begun before its flow
    done = started[0] if started else load_done_index(run.output, run.fingerprint)
    stream = started[1] if started else listing(run, done, claims)
    try:
        # The engine is the plan's: a multi-image job's per-prompt image limit is its group limit
        # (--max-images), so its engine, like the others', starts before the listing has ended.
        shards, spec = stream, run.engine
        run.log.info("run started", source=run.source.uri, output=run.output.uri, modality=work.modality,
                     questions=len(work.questions), already_done=len(done), partition=run.parts_id)
        pipeline = ShardPipeline(run, done, spec, claims)
        pipeline.run(claims.claimed(shards) if claims else shards)
    finally:
        stream.close()
    if claims is not None:  # the others' claimed shards, a gone partition's, then the plan's copies
        finish_partition(pipeline, run, claims, stream)
    return pipeline.close()


def finish_partition(pipeline: ShardPipeline, run: PartitionRun, claims: ShardClaims, plan: SharedListing) -> None:
    """After the shards it claimed from `plan`, a partition waits for the run's other claimed
    shards, captioning here those of a partition that is gone (tasks/claims.py), then takes the
    plan's copy shards once every other shard is done, with the done-index loaded again so that
    each copy finds its original's answer (tasks/shard_plan.py)."""
    def again(shards: str, pick: Callable[[Iterable[Listed]], Iterable[Listed]]) -> None:
        pipeline.done = load_done_index(run.output, run.fingerprint)  # with what was written since
        plan_again = listing(run, pipeline.done, claims, shards)  # the run's plan, read again
        try:
            pipeline.run(pick(plan_again))
        finally:
            plan_again.close()
        pipeline.drain_writes()

    def retake_until_done(until: Callable[[], bool] = lambda: True) -> None:
        while (retaken := claims.retake()) is not None or not until():
            if retaken:  # a gone partition's, captioned here (what it wrote before it went is on the done-index)
                again("all", lambda shards: (s for s in shards if isinstance(s, Shard) and s.index in retaken))
            else:
                time.sleep(RETAKE_POLL_S)

    pipeline.drain_writes()  # its own shards' parts and done marks written before it looks at the claims
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
    work = run.work
    pending = lambda items: done.pending_mask(items, work.questions)  # noqa: E731
    ended = functools.partial(keep_listing_end, run.output, run.source, run.fingerprint)  # the greatest key, at its end
    if claims is None:
        return ShardStream(run.source, work.shard_size, work.limit, pending=pending, on_end=ended).start()
    return SharedListing(run.output, run.run_id, claims, run.source, work.shard_size, work.limit,
                         pending, shards=shards, on_end=ended, dedup=work.dedup).start()


class ShardPipeline:
    """The schedule over one partition's shards: prepare ahead, keep `depth` shards in the
    engine, write each shard's part as soon as it is done. The steps run on this process's
    threads (`ShardSteps`); the counts, progress and Prefect's task runs (a batch of shards
    each) are `ShardReport`'s.

    A shard moves from the listing to `ahead` (its fetch and decode submitted), then to
    `in_flight` (its requests in the engine), then out (its part being written, in `writes`)."""

    def __init__(self, run: PartitionRun, done: DoneIndex, spec: EngineSpec, claims: ShardClaims | None = None):
        work = self.work = run.work
        self.done, self.claims = done, claims
        self.media_bytes, self.prepared_shards = 0, 0  # decoded media seen, to size the feed in bytes
        self.lookahead = max(1, get_settings().prepare_ahead)
        # Shards fetched and decoded at once while filling (each has its own fetch threads).
        self.filling = max(self.lookahead, shards_holding(FEED_ITEMS, work.shard_size, len(work.questions)))
        self.preparing: set = set()  # prepare futures not yet done
        media = MediaOptions(work.modality, work.num_frames, work.image_limit, resize=image_resize_target(spec),
                             frame_resize=frame_resize_target(spec), dedup=work.dedup)
        self.options = GenerateOptions(spec, work.sampling, work.method, work.num_frames, work.retry_looping,
                                       work.dedup)
        self.steps = ShardSteps(run.source, run.output, work.questions, media, self.options,
                                run.fingerprint, run.parts_id, run.log)
        self.report = ShardReport(run)
        self.stats = self.report.stats
        self.engine: dict | None = None
        self.starting = None  # the engine's start, submitted at the first item not done
        self.changed = threading.Event()  # a shard was prepared, or the engine came up
        self.listed = iter(())
        self.generate_started: float | None = None
        self.ahead, self.in_flight, self.writes = deque(), deque(), deque()

    def run(self, shards: Iterable[Listed]) -> None:
        """Caption `shards` (called again for shards retaken from a partition that is gone); the
        items already done that the listing hands over between them are counted. A failure that
        stops the run settles every shard taken, so that every batch's task run ends."""
        self.listed = iter(shards)
        try:
            self.prepare_ahead()
            while self.ahead:
                shard, preparing = self.ahead.popleft()
                prepared = preparing.result()
                self.size_feed(prepared[0])
                self.prepare_ahead()
                self.in_flight.append((shard, prepared, self.generate(prepared[0])))
                while len(self.in_flight) > self.depth:
                    self.finish(*self.in_flight.popleft())
            while self.in_flight:
                self.finish(*self.in_flight.popleft())
        except BaseException as exc:
            self.steps.shutdown()
            self.report.stop(exc)
            raise
        self.report.end_batch()

    def prepare_ahead(self) -> None:
        """While the engine starts (or after it ran dry) the feed's whole depth of shards is
        fetched and decoded, so the engine is full the moment it is up; once it runs,
        `prepare_ahead` shards are (VLM_CAPTION_PREPARE_AHEAD). Filling, at most FEED_ITEMS
        items are being prepared at once (each shard being prepared has its own fetch threads)."""
        while ((len(self.ahead) < self.lookahead
                or (len(self.ahead) + len(self.in_flight) <= self.depth and len(self.preparing) < self.filling))
               and (following := self.next_shard()) is not None):
            self.ahead.append((following, self.take(following)))

    def next_shard(self) -> Shard | None:
        """The listing's next shard; items already done it hands over are counted in-process."""
        for listed in self.listed:
            if not isinstance(listed, AlreadyDone):
                return listed
            self.report.skip(listed.items)

    @property
    def depth(self) -> int:
        """Shards in the engine at once: from the engine's batch (how vLLM sized it, once it is
        up) and the mean decoded bytes of the shards prepared so far."""
        work, sizing = self.work, self.engine["sizing"] if self.engine else None
        mean_bytes = self.media_bytes / self.prepared_shards if self.prepared_shards else None
        return feed_depth(work.modality, work.shard_size, len(work.questions), sizing, mean_bytes,
                          shared=self.claims is not None, request_tokens=self.stats.tokens_per_request())

    def size_feed(self, prepared) -> None:
        """Count a prepared shard's decoded media, which bounds the feed's depth."""
        if prepared.items:
            self.media_bytes += prepared.media_bytes
            self.prepared_shards += 1

    def take(self, shard: Shard):
        """A shard from the listing: counted, its fetch and decode submitted, and the engine
        started in the background at the first shard (the listing hands over only shards with
        work left: a run with nothing new starts no engine and no decode pool)."""
        self.report.take(shard)
        self.start_engine()
        preparing = self.steps.prepare(shard, self.done)
        self.preparing.add(preparing)
        preparing.add_done_callback(self.prepared_one)
        return preparing

    def start_engine(self) -> None:
        """The engine's start submitted once; the decode pool starts beside it."""
        if self.starting is None:
            ensure_vllm_imported()  # made by the flow's thread (tasks/engine/vllm_import.py), if not yet
            self.starting = start_engine.submit(self.options.spec)
            start_decode_pool(self.work.modality)

    def prepared_one(self, preparing) -> None:
        self.preparing.discard(preparing)
        self.changed.set()

    def generate(self, prepared):
        """The shard's requests handed to the engine (started at the first shard taken)."""
        if not prepared.items:
            return None
        self.engine = self.engine or self.await_engine()
        self.generate_started = self.generate_started or time.time()
        return self.steps.generate(prepared, self.engine["model"])

    def await_engine(self) -> dict:
        """The engine, once up; meanwhile the feed's depth of shards is prepared, a few at a
        time. Its batch is unknown until then, so the depth aims at the most the feed holds
        (FEED_REQUESTS, bounded by decoded bytes): with only FEED_ITEMS prepared while it started,
        the rest were decoded beside the first minute of generation (H100, 7B, 1920x1080)."""
        up = threading.Event()

        def started(_) -> None:
            up.set()
            self.changed.set()

        self.starting.add_done_callback(started)
        while not up.is_set():
            self.changed.wait(1.0)
            self.changed.clear()
            self.prepare_ahead()
        return self.starting.result()

    def finish(self, shard: Shard, prepared, generating) -> None:
        """The shard's records written as its part, counted, reported."""
        (prepared, failure), records = prepared, []
        if generating is not None:
            records, failed = generating.result()
            failure = failure or failed
        records = annotate_records(shard.items, records)  # a sample's or row's metadata
        if records:
            self.stats.mark_result()
        done_key = self.claims.done_key(shard.index) if self.claims is not None else None
        writing = self.steps.write(shard.index, records, done_key)
        self.report.writing(shard, writing, records, failure)
        self.writes.append((shard.index, writing, records))
        while len(self.writes) > self.depth:  # keep only the writes still in flight
            self.report.collect(*self.writes.popleft())
        self.report.shard_done(shard, prepared.skipped, records)

    def drain_writes(self) -> None:
        """Wait for every part being written (and counted)."""
        while self.writes:
            self.report.collect(*self.writes.popleft())

    def close(self) -> tuple[RunStats, dict | None]:
        stats = self.stats
        if self.engine is None and self.starting is not None:
            self.engine = self.starting.result()  # started for items that turned out done by content
        if self.generate_started is not None:
            stats.mark_generating(self.generate_started, time.time())  # first request to last result
        self.drain_writes()
        self.report.close()
        self.steps.shutdown()
        return stats, self.engine
