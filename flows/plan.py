"""A run's plan: the job resolved once, at the run's start, and handed down. `make_plan(job)` is
the pre-flight: every problem at once, one line each (docs/architecture.md, "The plan").
`PartitionRun`: what a partition's shards need of the plan, taken from it once (never the job)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlm_caption.flows.params import CaptionJob, Partition
from vlm_caption.recipes import Recipe, RecipeError
from vlm_caption.tasks.engine.arguments import EngineSpec
from vlm_caption.tasks.engine.vllm_engine import Sampling
from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.results.done_rows import has_results
from vlm_caption.tasks.results.layout import partition_parts_id
from vlm_caption.tasks.records import job_fingerprint
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.registry import READERS
from vlm_caption.tasks.sources.storage import Storage, StorageError
from vlm_caption.tasks.sources.watermark import object_after_listing_end, with_changed_since


class PreflightError(RecipeError):
    """One or more problems found before anything started; one line each, each saying what to do."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class RunPlan:
    """What a run reads and writes, with which recipe and model, resolved once."""

    job: CaptionJob  # source_format and column resolved (never `auto`)
    recipe: Recipe
    model: str  # the job's model or the recipe's for its modality
    fingerprint: str  # which results this run's are interchangeable with
    source: SourceSpec
    output: Storage  # where results, manifests, the gallery and Parquet go; partitions coordinate here
    # The engine to build, its arguments resolved; multi-image's per-prompt image limit is the
    # job's group limit, known before the listing.
    engine: EngineSpec | None = None


@dataclass(frozen=True)
class PartitionRun:
    """A partition being captioned in this process, with everything its shards need resolved."""

    run_id: str
    partition: Partition | None  # None: the run is not fanned out
    log: Any  # the run's structlog logger
    source: SourceSpec  # where the items come from, its storage opened
    output: Storage  # where the parts are written; partitions share their claims here
    fingerprint: str  # which results these are interchangeable with
    engine: EngineSpec  # the plan's
    title: str  # what is captioned with which recipe: the progress bar's label
    # What is done to each shard: the job's questions and how its media are read and asked.
    modality: str
    questions: tuple[str, ...]
    shard_size: int  # items per shard (and per results part)
    limit: int | None  # the most items listed, or None
    num_frames: int  # frames sampled from each video
    image_limit: int  # the most images a multi-image group may hold
    sampling: Sampling
    method: str  # "generate", or "chat" (the multi-image example's LLM.chat)
    retry_looping: float | None  # the repetition penalty a looping caption is asked again with, or None
    dedup: bool  # the same media captioned once (tasks/same_media.py)
    location: str  # the source or manifest as the job names it: its results' `source` column

    @classmethod
    def of(cls, plan: RunPlan, run_id: str, partition: Partition | None, log: Any) -> PartitionRun:
        job = plan.job
        return cls(run_id, partition, log, plan.source, plan.output, plan.fingerprint, plan.engine,
                   f"Captioning {job.location} with {plan.recipe.name}", job.modality, job.questions_to_ask,
                   job.shard_size, job.limit, job.num_frames, job.image_limit,
                   Sampling(**job.sampling.model_dump(), structured=job.structured_output), job.method,
                   job.retry_looping, job.dedup, job.location)

    @property
    def index(self) -> int:
        """This partition's number (0 when the run is not fanned out)."""
        return self.partition.index if self.partition else 0

    @property
    def parts_id(self) -> str:
        """Names this partition's result parts (`part-<parts_id>-<shard>.parquet`)."""
        return partition_parts_id(self.run_id, self.partition.index) if self.partition else self.run_id


def make_plan(job: CaptionJob) -> RunPlan:
    """Check the job and resolve it, or raise PreflightError naming every problem found."""
    from vlm_caption.tasks.engine.arguments import check_engine_overrides
    from vlm_caption.tasks.engine.model_check import check_model
    from vlm_caption.tasks.sources.preflight import check_output, resolve_source

    problems: list[Exception] = []

    def check(step: Callable[[], object]) -> object:
        try:
            return step()
        except (RecipeError, StorageError) as exc:  # each says what to do; ModelError is a RecipeError
            problems.append(exc)
            return None

    recipe = job.resolved_recipe
    engine = check(lambda: engine_spec(job))  # refuses remote code the job did not allow
    check(lambda: check_engine_overrides(job.engine_overrides))
    # A fan-out's other partitions read the source and write the output too: a local folder must be one they see.
    partitions_on = job.partition_deployment if job.fan_out > 1 else None
    resolved, source = check(lambda: resolve_source(job, partitions_on)) or (None, None)
    output = check(lambda: check_output(job.output, partitions_on))
    if not job.skip_model_check:  # the job's model, or the recipe's for its modality, loads and fits the recipe
        check(lambda: check_model(recipe, job.modality, job.model, revision=job.engine_overrides.get("revision")))
    if len(problems) == 1:
        raise problems[0]  # its own kind (StorageError, ModelError, ...), as each check raises it
    if problems:
        raise PreflightError([str(problem) for problem in problems])
    model = recipe.model_for(job.modality, job.model)
    fingerprint = fingerprint_of(resolved, recipe, model, source)
    return RunPlan(job=resolved, recipe=recipe, model=model, fingerprint=fingerprint,
                   source=with_changed_since(source, resolved.modified_since, output, fingerprint), output=output,
                   engine=engine)


def engine_spec(job: CaptionJob) -> EngineSpec:
    """The job's engine: its recipe's arguments for the modality (a multi-image job's for its image
    limit) with the job's overrides, and where it asks the model's processor to run."""
    images = job.image_limit if job.modality == "multi-image" else 1
    return EngineSpec.build(job.resolved_recipe, modality=job.modality, model=job.model,
                            engine_overrides=job.engine_overrides, trust_remote_code=job.trust_remote_code,
                            images=images, processor_device=job.processor_device)


def fingerprint_of(job: CaptionJob, recipe: Recipe, model: str, source: SourceSpec | None = None) -> str:
    """The results this job's are interchangeable with (see `job_fingerprint`). The source format
    says which location that is (an inventory's is its bucket's: a listing of that bucket and every
    day's report share results), and a format's media column is part of it (another column is other
    media under the same row ids)."""
    reader = READERS.get(job.source_format)  # None while `auto`, before the plan resolves it
    location = reader.results_location(job.location, source) if reader and job.manifest is None else job.location
    media = {"num_frames": job.num_frames} if job.modality == "video" else {}
    if reader is not None and reader.takes_column:
        media["column"] = job.column
    return job_fingerprint(
        source=location, recipe=recipe.name, model=model, modality=job.modality, method=job.method,
        media=media, sampling=job.sampling.model_dump(), structured=job.structured_output,
        retry_looping=job.retry_looping, dedup=job.dedup)


def start_engine_first(plan: RunPlan) -> bool:
    """Whether the run builds its engine first (no result of the job in the output yet, or objects after
    where its last complete listing ended: docs/architecture.md, "The engine starts first"), and if so its
    start, vLLM imported on the calling thread; a fan-out's parent builds nothing here (children first)."""
    if plan.job.partition is not None:  # a child of a fan-out: its parent looked when the run started
        first = plan.job.partition.engine_first
    else:
        first = not has_results(plan.output, plan.fingerprint)
        if not first and (newer := object_after_listing_end(plan.output, plan.source, plan.fingerprint)):
            get_logger().info("an object came after where the last listing ended", key=newer)
            first = True
    if first and plan.job.fan_out <= 1:
        build_engine_first(plan)
    return first


def build_engine_first(plan: RunPlan) -> None:
    """vLLM's import, then the run's engine started on a thread of its own (see `start_engine_first`)."""
    from vlm_caption.tasks.engine.vllm_engine import start_engine_early
    from vlm_caption.tasks.engine.vllm_import import ensure_vllm_imported

    ensure_vllm_imported()
    start_engine_early(plan.engine)
