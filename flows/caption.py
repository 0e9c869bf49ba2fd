"""The `vlm-caption` flow (docs/architecture.md, "The flow"): the plan made, this run's partition
captioned (flows/pipeline.py), with `fan_out=N` N-1 child runs started, waited for and merged into
the one manifest (tasks/fanout.py, tasks/claims.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import socket
import time
import uuid

from prefect import flow
from prefect.events import Event
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote

from vlm_caption.flows.head_start import settle_head_start
from vlm_caption.flows.params import CaptionJob, Partition
from vlm_caption.flows.pipeline import caption_shards
from vlm_caption.flows.plan import PartitionRun, RunPlan, build_engine_first, make_plan, start_engine_first
from vlm_caption.flows.run_state import fail_run, on_run_failed, run_label, run_name_from
from vlm_caption.tasks.claims import remove_claims, was_retaken
from vlm_caption.tasks.concurrency import one_run_per_job
from vlm_caption.tasks.engine.vllm_engine import discard_early_engine
from vlm_caption.tasks.errors import UserError
from vlm_caption.tasks.fanout import CALLED_OFF, ChildrenOnWork, start_children, wait_for_children, wait_for_orphans
from vlm_caption.tasks.observability import configure_logging, emit, get_logger, publish_summary
from vlm_caption.tasks.results.gallery import gallery_after_run
from vlm_caption.tasks.results.parquet_view import export_after_run
from vlm_caption.tasks.results.report import PartitionReport, RunStats
from vlm_caption.tasks.results.writers import (read_partition_reports, report_from_parts, write_manifest,
                                               write_partition_report)
from vlm_caption.tasks.sources.watermark import advance_watermark


# Prefect builds a model's validators at its first use, in the thread that uses it: the flow run's
# heartbeat thread would build its event's as the run starts, parsing Python beside the flow's own
# thread, which imports vLLM (tasks/engine/vllm_import.py says why two must not). Built here, first.
Event.model_rebuild()


def _run_id() -> str:
    return str(flow_run.id or uuid.uuid4())[:8] + time.strftime("-%Y%m%dT%H%M%S", time.gmtime())


def _where() -> dict:
    """Which worker, host, GPU and cores ran this partition, and when its run was asked for and its process
    began (the manifest's: with the engine's times, how the start splits between worker, Prefect, engine)."""
    import psutil

    from vlm_caption.tasks.media.pool import usable_cores

    return {"flow_run_id": str(flow_run.id) if flow_run.id else None,
            "worker": os.environ.get("PREFECT__WORKER_NAME"), "host": socket.gethostname(),
            "devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "cpus": str(usable_cores()),
            "asked_at": flow_run.scheduled_start_time.timestamp() if flow_run.id else None,
            "process_started_at": psutil.Process().create_time()}


@flow(name="vlm-caption", flow_run_name=lambda: run_name_from(flow_run.parameters), persist_result=False,
      on_failure=[on_run_failed])
def vlm_caption(job: CaptionJob) -> dict:
    """Caption every item under `job.source` (or of `job.manifest`) and write the results to
    `job.output` as Parquet (`parquet/`, read as one dataset): one record per (item, question)."""
    configure_logging()
    try:
        plan = make_plan(job)  # every check that needs no engine; locations, recipe, model
        run_id = job.partition.run_id if job.partition else _run_id()
        log = get_logger(run_id=run_id, recipe=plan.recipe.name, fingerprint=plan.fingerprint)
        # vLLM imported here, then the engine built beside the slot, the done-index and the listing; a
        # fan-out's parent asks for its children first (caption_job), their start beside its import.
        early = start_engine_first(plan)
        if early:
            log.info("engine starting first", why="the output holds no result of this job yet, or objects came "
                     "after where its last listing ended")
        # A child of a fan-out runs under its parent's slot; anything else takes the job's own first.
        lease = one_run_per_job(plan.fingerprint, job.output) if job.partition is None else contextlib.nullcontext()
        asked = time.monotonic()
        with lease:
            # `vlm-caption run` began a nightly run's done-index and listing already; kept if still true.
            settle_head_start(plan, slot_wait_s=time.monotonic() - asked)
            return caption_job(plan, run_id, log, engine_first=early)
    except UserError as exc:
        if not exc.permanent:
            raise  # an engine that died, a busy job: Prefect's retry, when the run has one
        return fail_run(exc)  # Failed at once, one line in the UI (raised to an in-process caller)
    finally:
        discard_early_engine()  # not taken: the run had nothing to do, or failed before its first item


def caption_job(plan: RunPlan, run_id: str, log, engine_first: bool = False) -> dict:
    """The run itself: this run's partition (and the children's, when fanned out), the manifest.
    `engine_first`: the run's engine is being built already, and its children's start at once too."""
    job, recipe, fingerprint = plan.job, plan.recipe, plan.fingerprint
    own, children, on_work = job.partition, [], None
    if job.fan_out > 1:
        own = Partition(index=0, count=job.fan_out, run_id=run_id, fingerprint=fingerprint, engine_first=engine_first)
        wait_for_orphans(job.partition_deployment, job.output, fingerprint)
        child_jobs = {i: job.model_copy(update={"fan_out": 1, "partition": own.model_copy(update={"index": i})})
                      .model_dump(mode="json") for i in range(1, job.fan_out)}
        ask_for_children = functools.partial(start_children, job.partition_deployment, child_jobs, run_label,
                                             attempt=flow_run.run_count or 1, parent_run_id=run_id)
        if engine_first:  # work at once (no result yet, or objects after the last listing): the children are
            children = ask_for_children()  # asked for before this process waits on vLLM's import, then the
            build_engine_first(plan)  # engine's start, beside theirs
        else:  # earlier results: asked for at the plan's first shard; a night with nothing new starts none
            on_work = ChildrenOnWork(plan.output, run_id, ask_for_children).start()
    try:
        run = PartitionRun.of(plan, run_id, own, log)  # what the shards need of the plan, handed down
        stats, engine, shared = caption_shards(run)
    except Exception:
        children += _stopped(on_work, log)
        if children:  # a retry of this run must not overlap this attempt's children
            # ...and children no worker has started are called off, not waited for forever
            wait_for_children(children, run_here=lambda child: "CANCELLED", claim_message=CALLED_OFF)
        raise
    if on_work is not None:
        children = on_work.stop()
        if not children:
            log.info("no child partition started: the shard plan held nothing to caption")
    stats.charge(engine)  # this partition's device-seconds, before the children's are added
    mine = stats.report(own.index if own else 0, engine, **(shared or {}), **_where())
    if job.partition is not None:  # a child: the parent writes the run's one manifest
        write_partition_report(plan.output, run_id, quote(mine))  # quote(): see the manifest's write below
        summary = stats.summary()
        publish_summary({**summary, "recipe": recipe.name, "partition": f"{own.index + 1}/{own.count}",
                         **(shared or {})}, stats.samples)
        return {**summary, "run_id": run_id, "partition": own.index, "fingerprint": fingerprint}

    partitions = [mine] + merge_children(run, children, stats) if children else []
    if own is not None:  # every partition has ended: the run's claims and shard plan go
        remove_claims(plan.output, run_id)
    manifest = stats.manifest(run_id=run_id, parameters=job.model_dump(mode="json"),
                              fingerprint=fingerprint, engine=engine,
                              partitions=[p.brief() for p in partitions])
    # quote(): Prefect walks a task's arguments for futures, and a manifest lists up to 10,000 flagged
    # records and as many failures (about a second of walking per write), none of them a future.
    manifest_uri = write_manifest(plan.output, run_id, quote(manifest))
    summary = stats.summary()
    facts = {"captioned": summary["succeeded"], "failed": summary["failed"],
             "already done": summary["skipped_already_done"], "cost": summary["cost"]}
    # The gallery reads the run's parts, before they are folded into its view file below.
    manifest["gallery"] = gallery_after_run(plan.output, plan.source, run_id, stats.parts, items=job.gallery_items,
                                            title=f"vlm-caption · {recipe.name} · {job.location}",
                                            fingerprint=fingerprint, facts=facts)
    # The run's parts folded into the output's Parquet view; a failure is recorded, not raised.
    manifest["parquet"] = export_after_run(plan.output, job.output, fingerprint, run_id)
    # --modified-since auto: the watermark moves on (keeping what to retry) where nothing can be lost.
    manifest["watermark"] = advance_watermark(plan.output, plan.source, stats, complete=job.limit is None and all(
        p.state == "COMPLETED" for p in partitions))
    write_manifest(plan.output, run_id, quote(manifest))
    summary["parquet"] = manifest["parquet"].get("path")
    summary["gallery"] = manifest["gallery"].get("path")
    publish_summary({**summary, "recipe": recipe.name, "model": engine["model"] if engine else plan.model,
                     "partitions": len(partitions) or 1, "manifest": manifest_uri}, stats.samples)
    emit("run.completed", run_id, **summary)
    log.info("run finished", manifest=manifest_uri, **summary)
    # Every claimed shard is done (this partition waited for them, retaking a gone partition's):
    # a child that failed or died is the manifest's to show, not a reason to fail the run.
    for p in partitions:
        if p.state != "COMPLETED":
            log.warning("a partition did not complete; its shards were captioned by the others",
                        partition=p.index, state=p.state)
    return {**summary, "run_id": run_id, "manifest": manifest_uri, "fingerprint": fingerprint,
            "failed_by_kind": dict(stats.failures_by_kind), "failures": stats.failures}


def _stopped(on_work: ChildrenOnWork | None, log) -> list:
    """The children the watch had started when the run's own partition failed (none if its own
    start failed too: that is logged, the partition's error is the run's)."""
    if on_work is None:
        return []
    try:
        return on_work.stop()
    except Exception as exc:  # noqa: BLE001 - the run fails with its partition's error
        log.error("starting the child partitions failed", error=str(exc))
        return []


def merge_children(run: PartitionRun, children, stats: RunStats) -> list[PartitionReport]:
    """Wait for the child runs, then add each partition's report to this run's counts. A child that
    died had its shards retaken (tasks/claims.py), so it does not fail the run; one no worker has
    started by now is claimed and run here, where it finds nothing left. `run` is partition 0."""
    taken_over: dict[int, PartitionReport] = {}

    def run_here(child) -> str:
        partition = Partition(index=child.index, count=run.partition.count, run_id=run.run_id,
                              fingerprint=run.fingerprint)
        try:
            child_stats, engine, shared = caption_shards(dataclasses.replace(run, partition=partition))
        except Exception as exc:  # reported as that partition's failure; the run fails at the end
            run.log.error("partition taken over from a child failed", partition=child.index, error=str(exc))
            taken_over[child.index] = PartitionReport(index=child.index, state="FAILED", **_where())
            return "FAILED"
        child_stats.charge(engine)
        taken_over[child.index] = child_stats.report(child.index, engine, **(shared or {}), **_where())
        return "COMPLETED"

    states = wait_for_children(children, run_here)
    reports = read_partition_reports(run.output, run.run_id, [c.index for c in children if c.index not in taken_over])
    reports.update(taken_over)
    merged = []
    for child in children:
        if child.index in reports:
            report = reports[child.index]
            report.state = states[child.index]
        else:  # no report: it died; what it had claimed and not finished was retaken
            report = _written_by(run, child)
            report.state = (f"{states[child.index]} (no report: counted from the {len(report.parts)} parts it "
                            "wrote; its unfinished shards were retaken)")
        stats.absorb(report)
        merged.append(report)
    return merged


def _written_by(run: PartitionRun, child) -> PartitionReport:
    """What a child that died had written (its parts, read back), so that the manifest counts
    every item captioned. Its results are whole without this: a failed read costs only the counts."""
    try:
        report = report_from_parts(run.output, run.fingerprint, run.run_id, child.index,
                                   lambda shard: was_retaken(run.output, run.run_id, shard))
    except Exception as exc:  # noqa: BLE001 - logged; the run's results do not depend on it
        run.log.warning("the parts of a partition that left no report could not be counted", partition=child.index,
                        error=f"{type(exc).__name__}: {exc}")
        report = PartitionReport(index=child.index)
    report.flow_run_id = child.flow_run_id
    return report
