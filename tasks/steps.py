"""The pipeline's Prefect tasks. Each runs on a whole shard, never on one image.

list (lazy) -> prepare_shard (fetch with bounded concurrency, hash, decode) -> generate_shard
(vLLM) -> write_shard (atomic JSON Lines) ... -> write_manifest (last).

Output layout under the output URI:
    results/<fingerprint>/part-<run_id>-<shard>.jsonl   one record per input object
    manifests/<run_id>.json                             written when the run ends
The fingerprint names the recipe + model + question + sampling; a rerun with the same ones
reads the earlier records and skips every object whose result is already there.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from prefect import task
from prefect.cache_policies import NONE

from tasks.engine import EngineSpec, MediaPrompt, Sampling, get_engine
from tasks.media import MediaError, decode_image
from tasks.observability import get_logger
from tasks.records import (
    ItemError,
    ObjectRef,
    PreparedItem,
    PreparedShard,
    ResultRecord,
    Shard,
    partition_of,
    sha256_hex,
)
from tasks.report import PartitionReport
from tasks.settings import get_settings
from tasks.storage import Storage, open_storage


def results_prefix(fingerprint: str) -> str:
    return f"results/{fingerprint}/"


def manifest_key(run_id: str) -> str:
    return f"manifests/{run_id}.json"


def partition_report_key(run_id: str, index: int) -> str:
    return f"partitions/{run_id}/p{index:03d}.json"


# ---- listing -------------------------------------------------------------------------------
def iter_shards(refs: Iterable[ObjectRef], shard_size: int, limit: int | None = None) -> Iterator[Shard]:
    """Group a (lazy) listing into shards of `shard_size` objects, stopping after `limit`."""
    batch: list[ObjectRef] = []
    index = 0
    for count, ref in enumerate(refs, start=1):
        if limit is not None and count > limit:
            break
        batch.append(ref)
        if len(batch) == shard_size:
            yield Shard(index, tuple(batch))
            index, batch = index + 1, []
    if batch:
        yield Shard(index, tuple(batch))


def in_partition(refs: Iterable[ObjectRef], limit: int | None,
                 partition: tuple[int, int] | None) -> Iterator[ObjectRef]:
    """The first `limit` listed objects (the whole job's limit), then only this partition's keys."""
    for count, ref in enumerate(refs, start=1):
        if limit is not None and count > limit:
            return
        if partition is None or partition_of(ref.key, partition[1]) == partition[0]:
            yield ref


@task(name="list-source", cache_policy=NONE, persist_result=False, retries=2, retry_delay_seconds=5)
def list_source(source_uri: str, glob: str | None, shard_size: int, limit: int | None,
                partition: tuple[int, int] | None = None) -> list[Shard]:
    """Page through the source (never loading object bytes) and cut it into shards.

    `partition=(index, count)` keeps the keys that hash to `index`: the runs of a fan-out list
    the same source and each takes a disjoint slice, so no object is captioned twice."""
    storage = open_storage(source_uri)
    shards = list(iter_shards(in_partition(storage.iter_objects(glob), limit, partition), shard_size))
    get_logger(source=source_uri).info(
        "listed source", objects=sum(len(s.objects) for s in shards), shards=len(shards),
        partition=f"{partition[0]}/{partition[1]}" if partition else None,
    )
    return shards


# ---- idempotency ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DoneEntry:
    etag: str
    size: int
    sha256: str | None


@task(name="load-done-index", cache_policy=NONE, persist_result=False, retries=2)
def load_done_index(output_uri: str, fingerprint: str) -> dict[str, DoneEntry]:
    """Objects that earlier runs with this fingerprint finished for good (captioned, or failed
    in a way a rerun would only repeat)."""
    out = open_storage(output_uri, create=True)
    done: dict[str, DoneEntry] = {}
    for part in out.iter_objects(glob="*.jsonl", prefix=results_prefix(fingerprint)):
        for line in out.read(part.key).splitlines():  # keys are relative to the storage root
            if not line.strip():
                continue
            record = ResultRecord.model_validate_json(line)
            if record.is_final:
                done[record.key] = DoneEntry(record.etag, record.size, record.sha256)
    return done


def is_done(ref: ObjectRef, done: dict[str, DoneEntry]) -> bool:
    entry = done.get(ref.key)
    return entry is not None and entry.etag == ref.etag and entry.size == ref.size


# ---- fetch and decode ----------------------------------------------------------------------
def _fetch_and_decode(storage: Storage, ref: ObjectRef, done: dict[str, DoneEntry],
                      max_pixels: int) -> PreparedItem | None:
    item = PreparedItem(ref)
    started = time.perf_counter()
    try:
        data = storage.read(ref.key)
    except Exception as exc:  # noqa: BLE001 - recorded, retried by the next run
        item.error = ItemError("fetch", f"{type(exc).__name__}: {exc}", retryable=True)
        return item
    item.fetch_s = time.perf_counter() - started
    item.sha256 = sha256_hex(data)
    entry = done.get(ref.key)
    if entry is not None and entry.sha256 == item.sha256:
        return None  # re-uploaded with the same content: already captioned
    started = time.perf_counter()
    try:
        item.media = decode_image(data, max_pixels=max_pixels)
    except MediaError as exc:
        item.error = exc.error
    item.decode_s = time.perf_counter() - started
    return item


@task(name="prepare-shard", cache_policy=NONE, persist_result=False)
def prepare_shard(source_uri: str, shard: Shard, done: dict[str, DoneEntry]) -> PreparedShard:
    """Fetch (bounded concurrency), hash and decode one shard; skip what is already done."""
    settings = get_settings()
    storage = open_storage(source_uri)
    todo = [ref for ref in shard.objects if not is_done(ref, done)]
    prepared = PreparedShard(shard, skipped=len(shard.objects) - len(todo))
    if todo:
        workers = max(1, min(settings.fetch_concurrency, len(todo)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fetch") as pool:
            items = pool.map(
                lambda ref: _fetch_and_decode(storage, ref, done, settings.max_image_pixels), todo
            )
            for item in items:
                if item is None:
                    prepared.skipped += 1
                else:
                    prepared.items.append(item)
    return prepared


# ---- generate ------------------------------------------------------------------------------
@task(name="start-engine", cache_policy=NONE, persist_result=False)
def start_engine(spec: EngineSpec) -> dict:
    """Load the model once for this worker process (reused by every later shard)."""
    engine = get_engine(spec)
    get_logger(recipe=spec.recipe).info("engine ready", model=engine.model,
                                        startup_s=round(engine.startup_s, 1))
    return {"model": engine.model, "startup_s": engine.startup_s,
            "engine_args": {k: repr(v) if not _jsonable(v) else v for k, v in engine.args.items()}}


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


@task(name="generate-shard", cache_policy=NONE, persist_result=False)
def generate_shard(spec: EngineSpec, prepared: PreparedShard, question: str,
                   sampling: Sampling, fingerprint: str, run_id: str) -> list[ResultRecord]:
    """Caption every decoded item of a shard in one vLLM call; every object gets a record."""
    engine = get_engine(spec)
    prompt = engine.prompt_for(question)
    ready = [item for item in prepared.items if item.error is None]
    started = time.perf_counter()
    outputs = engine.generate(
        [MediaPrompt(prompt, item.media, item.sha256 or "") for item in ready], sampling
    )
    per_item_s = (time.perf_counter() - started) / max(len(ready), 1)
    by_key = {item.ref.key: output for item, output in zip(ready, outputs)}
    records = []
    for item in prepared.items:
        output = by_key.get(item.ref.key)
        error = item.error
        if output is not None and output.error is not None:
            error = ItemError("generate", output.error, retryable=False)
        records.append(ResultRecord(
            key=item.ref.key, size=item.ref.size, etag=item.ref.etag, sha256=item.sha256,
            recipe=spec.recipe, model=engine.model, prompt=prompt,
            text=output.text if output else None,
            finish_reason=output.finish_reason if output else None,
            prompt_tokens=output.prompt_tokens if output else 0,
            output_tokens=output.output_tokens if output else 0,
            error=asdict(error) if error else None,
            timings={"fetch_s": round(item.fetch_s, 4), "decode_s": round(item.decode_s, 4),
                     "generate_s": round(per_item_s, 4) if output else 0.0},
            fingerprint=fingerprint, run_id=run_id,
        ))
        item.media = None  # release the decoded pixels as soon as they are consumed
    return records


# ---- write ---------------------------------------------------------------------------------
@task(name="write-shard", cache_policy=NONE, persist_result=False, retries=3, retry_delay_seconds=2)
def write_shard(output_uri: str, fingerprint: str, run_id: str, shard_index: int,
                records: list[ResultRecord]) -> str | None:
    """One JSON Lines file per shard, written atomically. Nothing to write, no file."""
    if not records:
        return None
    out = open_storage(output_uri, create=True)
    key = f"{results_prefix(fingerprint)}part-{run_id}-{shard_index:05d}.jsonl"
    body = "".join(record.model_dump_json() + "\n" for record in records)
    out.write(key, body.encode())
    return out.describe(key)


@task(name="write-manifest", cache_policy=NONE, persist_result=False, retries=3, retry_delay_seconds=2)
def write_manifest(output_uri: str, run_id: str, manifest: dict) -> str:
    out = open_storage(output_uri, create=True)
    out.write(manifest_key(run_id), json.dumps(manifest, indent=2, default=str).encode())
    return out.describe(manifest_key(run_id))


@task(name="write-partition-report", cache_policy=NONE, persist_result=False, retries=3,
      retry_delay_seconds=2)
def write_partition_report(output_uri: str, run_id: str, report: PartitionReport) -> str:
    """A child run's accounting, for the parent's single manifest (flow results are not shared)."""
    out = open_storage(output_uri, create=True)
    out.write(partition_report_key(run_id, report.index), report.model_dump_json(indent=2).encode())
    return out.describe(partition_report_key(run_id, report.index))


@task(name="read-partition-reports", cache_policy=NONE, persist_result=False, retries=2)
def read_partition_reports(output_uri: str, run_id: str, indexes: list[int]) -> dict[int, PartitionReport]:
    """The reports the children wrote; a child that died before writing one is simply absent."""
    out = open_storage(output_uri, create=True)
    return {index: PartitionReport.model_validate_json(out.read(partition_report_key(run_id, index)))
            for index in indexes if out.exists(partition_report_key(run_id, index))}
