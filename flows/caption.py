"""The `vlm-caption` flow: a folder or bucket of images in, one result record per image out.

    list source ──> shards ──> prepare (fetch+decode, next shard) ─┐
                                                                   ├─> generate (vLLM) ─> write part
                               prepare overlaps the current generate┘
    ... all shards ──> manifest ──> summary artifacts
"""

from __future__ import annotations

import time
import uuid

from prefect import flow
from prefect.runtime import flow_run

from flows.params import CaptionJob
from recipes import get_recipe
from tasks.engine import EngineSpec, Sampling, check_remote_code
from tasks.observability import Progress, configure_logging, emit, get_logger, publish_summary
from tasks.records import job_fingerprint
from tasks.report import RunStats
from tasks.steps import (
    generate_shard,
    list_source,
    load_done_index,
    prepare_shard,
    start_engine,
    write_manifest,
    write_shard,
)


def _run_name() -> str:
    job = flow_run.parameters.get("job", {})
    job = job if isinstance(job, dict) else job.model_dump()
    return f"{job.get('recipe', 'llava')} · {job.get('source', '?')}"


def _run_id() -> str:
    return str(flow_run.id or uuid.uuid4())[:8] + time.strftime("-%Y%m%dT%H%M%S", time.gmtime())


@flow(name="vlm-caption", flow_run_name=_run_name, persist_result=False)
def vlm_caption(job: CaptionJob) -> dict:
    """Caption every image under `job.source` and write JSON Lines results to `job.output`."""
    configure_logging()
    recipe = get_recipe(job.recipe)
    check_remote_code(recipe, job.trust_remote_code)  # refuse before touching storage or GPU
    run_id = _run_id()
    spec = EngineSpec.build(job.recipe, modality=job.modality, model=job.model,
                            engine_overrides=job.engine_overrides,
                            trust_remote_code=job.trust_remote_code)
    sampling = Sampling(**job.sampling.model_dump())
    fingerprint = job_fingerprint(recipe=recipe.name, model=recipe.model_for(job.modality, job.model),
                                  question=job.question, sampling=job.sampling.fingerprint_dict())
    log = get_logger(run_id=run_id, recipe=recipe.name, fingerprint=fingerprint)
    stats = RunStats()

    shards = list_source(job.source, job.glob, job.shard_size, job.limit)
    done = load_done_index(job.output, fingerprint)
    progress = Progress(len(shards), f"Captioning {job.source} with {recipe.name}")
    log.info("run started", source=job.source, output=job.output, shards=len(shards),
             already_done=len(done))

    engine = None
    writes = []
    next_prepared = prepare_shard.submit(job.source, shards[0], done) if shards else None
    for position, shard in enumerate(shards):
        prepared = next_prepared.result()
        # Fetch and decode the next shard while this one is on the GPU.
        has_next = position + 1 < len(shards)
        next_prepared = prepare_shard.submit(job.source, shards[position + 1], done) if has_next else None
        records, generate_s = [], 0.0
        if prepared.items:
            engine = engine or start_engine(spec)
            started = time.perf_counter()
            records = generate_shard(spec, prepared, job.question, sampling, fingerprint, run_id)
            generate_s = time.perf_counter() - started
        writes.append(write_shard.submit(job.output, fingerprint, run_id, shard.index, records))
        stats.add(prepared, records, generate_s)
        failed = sum(1 for r in records if r.error)
        percent = progress.advance()
        emit("shard.failed" if failed else "shard.completed", run_id, shard=shard.index,
             objects=len(shard.objects), skipped=prepared.skipped, failed=failed)
        log.info("shard done", shard=shard.index, objects=len(shard.objects),
                 skipped=prepared.skipped, failed=failed, progress=percent)

    stats.parts = [part for part in (w.result() for w in writes) if part]
    manifest = stats.manifest(run_id=run_id, parameters=job.model_dump(mode="json"),
                              fingerprint=fingerprint, engine=engine)
    manifest_uri = write_manifest(job.output, run_id, manifest)
    summary = stats.summary()
    publish_summary({**summary, "recipe": recipe.name, "model": manifest["engine"]["model"]
                     if engine else recipe.model_for(job.modality, job.model),
                     "manifest": manifest_uri}, stats.samples)
    emit("run.completed", run_id, **summary)
    log.info("run finished", manifest=manifest_uri, **summary)
    return {**summary, "run_id": run_id, "manifest": manifest_uri, "fingerprint": fingerprint,
            "failures": stats.failures}
