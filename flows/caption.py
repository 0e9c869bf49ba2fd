"""The `vlm-caption` flow: images, videos or image groups in a folder or bucket (or the lines
of a job manifest) in, one result record per (item, question) out.

    preflight ──> one run per job ──> list source (streamed) ──> shards
        prepare (fetch + decode, the next shard) ─┐
        start engine (background, once) ──────────┼─> generate (continuous feed) ─> write part
        several shards in the engine at once ─────┘
    ... all shards ──> manifest ──> summary artifacts

With `fan_out=N` the run also starts N-1 child runs (tasks/fanout.py), captions partition 0
itself, captions any child partition no worker has started by then (work stealing), waits for
the rest and merges their reports into the one manifest.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows.params import CaptionJob, Partition
from recipes import Recipe, get_recipe
from tasks.concurrency import one_run_per_job
from tasks.engine.feed import feed_depth
from tasks.engine.steps import GenerateOptions, generate_shard, start_engine
from tasks.engine.arguments import (EngineSpec, check_engine_overrides, check_remote_code,
                                     image_resize_target)
from tasks.engine.vllm_engine import Sampling, ensure_vllm_imported
from tasks.fanout import CALLED_OFF, FanOutError, start_children, wait_for_children, wait_for_orphans
from tasks.media.prepare import MediaOptions, prepare_shard
from tasks.observability import Progress, configure_logging, emit, get_logger, publish_summary
from tasks.results.done_index import DoneIndex, load_done_index
from tasks.results.records import job_fingerprint
from tasks.results.report import PartitionReport, RunStats
from tasks.results.writers import read_partition_reports, write_manifest, write_partition_report, write_shard
from tasks.settings import get_settings
from tasks.sources.items import Shard
from tasks.sources.listing import ShardStream, SourceSpec
from tasks.sources.preflight import check_output, check_source


@dataclass(frozen=True)
class PartitionRun:
    """One partition of a job being captioned in this process (the whole job when not fanned out)."""

    job: CaptionJob
    recipe: Recipe
    fingerprint: str
    run_id: str
    partition: Partition | None
    log: Any

    @property
    def parts_id(self) -> str:
        """Names this partition's result parts (`part-<parts_id>-<shard>.jsonl`)."""
        return f"{self.run_id}-p{self.partition.index}" if self.partition else self.run_id

    @property
    def source(self) -> SourceSpec:
        job = self.job
        return SourceSpec(job.location, job.modality, is_manifest=job.manifest is not None, glob=job.glob)


def run_label(job: dict) -> str:
    """`<recipe> · <source>`, and `[i/N]` for a partition of a fanned-out run."""
    name = f"{job.get('recipe', 'llava')} · {job.get('source') or job.get('manifest') or '?'}"
    part = job.get("partition")
    return f"{name} [{part['index'] + 1}/{part['count']}]" if part else name


def _run_name() -> str:
    job = flow_run.parameters.get("job", {})
    return run_label(job if isinstance(job, dict) else job.model_dump())


def _run_id() -> str:
    return str(flow_run.id or uuid.uuid4())[:8] + time.strftime("-%Y%m%dT%H%M%S", time.gmtime())


def _where() -> dict:
    """Which worker, host and GPU ran this partition (shown in the manifest)."""
    return {"flow_run_id": str(flow_run.id) if flow_run.id else None,
            "worker": os.environ.get("PREFECT__WORKER_NAME"), "host": socket.gethostname(),
            "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


@flow(name="vlm-caption", flow_run_name=_run_name, persist_result=False)
def vlm_caption(job: CaptionJob) -> dict:
    """Caption every item under `job.source` (or of `job.manifest`) and write JSON Lines
    results to `job.output`: one record per (item, question)."""
    configure_logging()
    ensure_vllm_imported()  # before any thread of this flow imports a part of it
    recipe = get_recipe(job.recipe)
    check_remote_code(recipe, job.trust_remote_code)  # refuse before touching storage or GPU
    check_engine_overrides(job.engine_overrides)
    check_source(job.location, is_manifest=job.manifest is not None)
    check_output(job.output)
    run_id = job.partition.run_id if job.partition else _run_id()
    model = recipe.model_for(job.modality, job.model)
    fingerprint = fingerprint_of(job, recipe, model)
    log = get_logger(run_id=run_id, recipe=recipe.name, fingerprint=fingerprint)
    # A child of a fan-out runs under its parent's slot; anything else takes the job's own first.
    lease = one_run_per_job(fingerprint, job.output) if job.partition is None else contextlib.nullcontext()
    with lease:
        return caption_job(job, recipe, run_id, model, fingerprint, log)


def fingerprint_of(job: CaptionJob, recipe: Recipe, model: str) -> str:
    """The results this job's are interchangeable with (see `job_fingerprint`)."""
    return job_fingerprint(
        source=job.location, recipe=recipe.name, model=model, modality=job.modality, method=job.method,
        media={"num_frames": job.num_frames} if job.modality == "video" else {},
        sampling=job.sampling.fingerprint_dict())


def caption_job(job: CaptionJob, recipe: Recipe, run_id: str, model: str, fingerprint: str, log) -> dict:
    """The run itself: this run's partition (and the children's, when fanned out), the manifest."""
    own, children = job.partition, []
    if job.fan_out > 1:
        own = Partition(index=0, count=job.fan_out, run_id=run_id, fingerprint=fingerprint)
        wait_for_orphans(job.partition_deployment, job.output, fingerprint)
        child_jobs = {i: job.model_copy(update={"fan_out": 1, "partition": own.model_copy(update={"index": i})})
                      .model_dump(mode="json") for i in range(1, job.fan_out)}
        children = start_children(job.partition_deployment, child_jobs, run_label,
                                  attempt=flow_run.run_count or 1, parent_run_id=run_id)
    try:
        stats, engine = caption_shards(PartitionRun(job, recipe, fingerprint, run_id, own, log))
    except Exception:
        if children:  # a retry of this run must not overlap this attempt's children
            # ...and children no worker has started are called off, not waited for forever
            wait_for_children(children, run_here=lambda child: "CANCELLED", claim_message=CALLED_OFF)
        raise
    mine = stats.report(own.index if own else 0, engine, **_where())
    if job.partition is not None:  # a child: the parent writes the run's one manifest
        write_partition_report(job.output, run_id, mine)
        summary = stats.summary()
        publish_summary({**summary, "recipe": recipe.name, "partition": f"{own.index + 1}/{own.count}"},
                        stats.samples)
        return {**summary, "run_id": run_id, "partition": own.index, "fingerprint": fingerprint}

    partitions = [mine] + merge_children(job, recipe, fingerprint, run_id, children, stats, log) if children else []
    manifest = stats.manifest(run_id=run_id, parameters=job.model_dump(mode="json"),
                              fingerprint=fingerprint, engine=engine,
                              partitions=[p.brief() for p in partitions])
    manifest_uri = write_manifest(job.output, run_id, manifest)
    summary = stats.summary()
    publish_summary({**summary, "recipe": recipe.name, "model": engine["model"] if engine else model,
                     "partitions": len(partitions) or 1, "manifest": manifest_uri}, stats.samples)
    emit("run.completed", run_id, **summary)
    log.info("run finished", manifest=manifest_uri, **summary)
    incomplete = {p.index: p.state for p in partitions if p.state != "COMPLETED"}
    if incomplete:
        raise FanOutError(f"partitions {incomplete} did not complete; {manifest_uri} counts what was done. "
                          "Run the deployment again: objects already done are skipped.")
    return {**summary, "run_id": run_id, "manifest": manifest_uri, "fingerprint": fingerprint,
            "failures": stats.failures}


def caption_shards(run: PartitionRun) -> tuple[RunStats, dict | None]:
    """Caption this run's items (one partition of them when fanned out) shard by shard as the
    listing streams them in, fetching the next shard while the current ones are on the GPU."""
    job, partition = run.job, run.partition
    done = load_done_index(job.output, run.fingerprint)
    stream = ShardStream(run.source, job.shard_size, job.limit,
                         (partition.index, partition.count) if partition else None).start()
    try:
        # Multi-image sizes vLLM's per-prompt image limit from the largest group, so that
        # listing is read whole first; image and video start on the first shard listed.
        if job.modality == "multi-image":
            shards: Iterable[Shard] = list(stream)
            spec = engine_spec(job, shards)
        else:
            shards, spec = stream, engine_spec(job, [])
        run.log.info("run started", source=job.location, output=job.output, modality=job.modality,
                     questions=len(job.questions_to_ask), already_done=len(done), partition=run.parts_id)
        return ShardPipeline(run, done, spec).run(shards)
    finally:
        stream.close()


class ShardPipeline:
    """The pipeline over one partition's shards: prepare ahead, keep `depth` shards in the
    engine, write each shard's part as soon as it is done.

    A shard moves from the listing to `ahead` (its fetch and decode submitted), then to
    `in_flight` (its requests in the engine), then out (its part being written, in `writes`)."""

    def __init__(self, run: PartitionRun, done: DoneIndex, spec: EngineSpec):
        job = run.job
        self.partition_run, self.job, self.done = run, job, done
        self.depth_for = functools.partial(feed_depth, job.modality, job.shard_size, len(job.questions_to_ask))
        self.depth = self.depth_for(None)  # until the engine's sizing is known
        self.lookahead = max(1, get_settings().prepare_ahead)
        self.stats = RunStats()
        self.media = MediaOptions(job.modality, job.num_frames, job.image_limit, resize=image_resize_target(spec))
        self.options = GenerateOptions(spec, Sampling(**job.sampling.model_dump()), job.method, job.num_frames)
        self.progress = Progress(f"Captioning {job.location} with {run.recipe.name}")
        self.engine: dict | None = None
        self.starting = None  # the engine's start, submitted at the first item not done
        self.generate_started: float | None = None
        self.ahead, self.in_flight, self.writes = deque(), deque(), deque()

    def run(self, shards: Iterable[Shard]) -> tuple[RunStats, dict | None]:
        listed = iter(shards)
        self.prepare_ahead(listed)
        while self.ahead:
            shard, preparing = self.ahead.popleft()
            prepared = preparing.result()
            self.prepare_ahead(listed)
            self.in_flight.append((shard, prepared, self.generate(prepared)))
            while len(self.in_flight) > self.depth:
                self.finish(*self.in_flight.popleft())
        while self.in_flight:
            self.finish(*self.in_flight.popleft())
        return self.close()

    def prepare_ahead(self, listed) -> None:
        """While the engine starts (or after it ran dry) a whole feed's worth of shards is
        fetched and decoded at once, so the engine is full the moment it is up; once it runs,
        `prepare_ahead` shards are (VLM_CAPTION_PREPARE_AHEAD)."""
        while ((len(self.ahead) < self.lookahead or len(self.ahead) + len(self.in_flight) <= self.depth)
               and (following := next(listed, None)) is not None):
            self.ahead.append((following, self.take(following)))

    def take(self, shard: Shard):
        """A shard from the listing: counted, its fetch and decode submitted, and the engine
        started in the background at the first item not already done."""
        job = self.job
        self.progress.grow(len(shard.items))
        if self.starting is None and any(self.done.pending_by_listing(item, item.questions or job.questions_to_ask)
                                         for item in shard.items):
            self.starting = start_engine.submit(self.options.spec)
        return prepare_shard.submit(self.partition_run.source, shard, self.done, job.questions_to_ask, self.media)

    def generate(self, prepared):
        """The shard's requests handed to the engine (started here if it is not yet)."""
        if not prepared.items:
            return None
        if self.engine is None:
            self.engine = self.starting.result() if self.starting else start_engine(self.options.spec)
            self.depth = self.depth_for(self.engine["sizing"])
        self.generate_started = self.generate_started or time.time()
        run = self.partition_run
        return generate_shard.submit(prepared, self.options, run.fingerprint, run.parts_id)

    def finish(self, shard: Shard, prepared, generating) -> None:
        """The shard's records written as its part, counted, reported."""
        run, stats = self.partition_run, self.stats
        records = generating.result() if generating is not None else []
        if records:
            stats.mark_result()
        self.writes.append(write_shard.submit(self.job.output, run.fingerprint, run.parts_id, shard.index, records))
        while len(self.writes) > self.depth:  # keep only the writes still in flight
            stats.parts.append(self.writes.popleft().result())
        stats.add(len(shard.items), prepared.skipped, records)
        failed = sum(1 for r in records if r.error)
        percent = self.progress.advance(len(shard.items), failed)
        emit("shard.failed" if failed else "shard.completed", run.run_id, shard=shard.index,
             partition=run.partition.index if run.partition else 0, objects=len(shard.items),
             skipped=prepared.skipped, failed=failed)
        run.log.info("shard done", shard=shard.index, items=len(shard.items), records=len(records),
                     skipped=prepared.skipped, failed=failed, progress=percent)

    def close(self) -> tuple[RunStats, dict | None]:
        stats = self.stats
        self.progress.close()
        if self.engine is None and self.starting is not None:
            self.engine = self.starting.result()  # started for items that turned out done by content
        if self.generate_started is not None:
            stats.mark_generating(self.generate_started, time.time())  # first request to last result
        stats.parts += [w.result() for w in self.writes]
        stats.parts = [part for part in stats.parts if part]
        return stats, self.engine


def engine_spec(job: CaptionJob, shards: list[Shard]) -> EngineSpec:
    """The engine for this job. For multi-image, vLLM's per-prompt image limit comes from the
    largest group listed (as the example sets it from its image count), capped by the job's."""
    images = 1
    if job.modality == "multi-image":
        largest = max((len(item.members) for shard in shards for item in shard.items), default=1)
        images = max(1, min(largest, job.image_limit))
    return EngineSpec.build(job.recipe, modality=job.modality, model=job.model,
                            engine_overrides=job.engine_overrides,
                            trust_remote_code=job.trust_remote_code, images=images)


def merge_children(job: CaptionJob, recipe: Recipe, fingerprint: str, run_id: str, children,
                   stats: RunStats, log) -> list[PartitionReport]:
    """Wait for the child runs, captioning here any that no worker has started, then add each
    partition's report to this run's counts."""
    taken_over: dict[int, PartitionReport] = {}

    def run_here(child) -> str:
        partition = Partition(index=child.index, count=job.fan_out, run_id=run_id, fingerprint=fingerprint)
        try:
            child_stats, engine = caption_shards(PartitionRun(job, recipe, fingerprint, run_id, partition, log))
        except Exception as exc:  # reported as that partition's failure; the run fails at the end
            log.error("partition taken over from a child failed", partition=child.index, error=str(exc))
            taken_over[child.index] = PartitionReport(index=child.index, state="FAILED", **_where())
            return "FAILED"
        taken_over[child.index] = child_stats.report(child.index, engine, **_where())
        return "COMPLETED"

    states = wait_for_children(children, run_here)
    reports = read_partition_reports(job.output, run_id, [c.index for c in children if c.index not in taken_over])
    reports.update(taken_over)
    merged = []
    for child in children:
        report = reports.get(child.index) or PartitionReport(index=child.index, flow_run_id=child.flow_run_id)
        report.state = states[child.index] if child.index in reports else states[child.index] + " (no report)"
        stats.absorb(report)
        merged.append(report)
    return merged
