"""One partition of a run as this process captions it (the whole run when not fanned out): what
its shards need of the run's plan (flows/plan.py), taken from it once, at the partition's start.
The pipeline and what it drives are handed these values, never the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlm_caption.flows.params import CaptionJob, Partition
from vlm_caption.flows.plan import RunPlan
from vlm_caption.tasks.engine.arguments import EngineSpec
from vlm_caption.tasks.engine.vllm_engine import Sampling
from vlm_caption.tasks.results.layout import partition_parts_id
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.storage import Storage


@dataclass(frozen=True)
class ShardWork:
    """What is done to each shard: the job's questions and how its media are read and asked."""

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

    @classmethod
    def of(cls, job: CaptionJob) -> ShardWork:
        return cls(job.modality, job.questions_to_ask, job.shard_size, job.limit, job.num_frames, job.image_limit,
                   Sampling(**job.sampling.model_dump(), structured=job.structured_output), job.method,
                   job.retry_looping, job.dedup)


@dataclass(frozen=True)
class PartitionRun:
    """A partition being captioned in this process, with everything its shards need resolved."""

    run_id: str
    partition: Partition | None  # None: the run is not fanned out
    log: Any  # the run's structlog logger
    source: SourceSpec  # where the items come from, its storage opened
    output: Storage  # where the parts are written; partitions share their claims here
    fingerprint: str  # which results these are interchangeable with
    engine: EngineSpec  # multi-image's is narrowed to the largest group listed (flows/pipeline.py)
    work: ShardWork
    title: str  # what is captioned with which recipe: the progress bar's label

    @classmethod
    def of(cls, plan: RunPlan, run_id: str, partition: Partition | None, log: Any) -> PartitionRun:
        return cls(run_id, partition, log, plan.source, plan.output, plan.fingerprint, plan.engine,
                   ShardWork.of(plan.job), f"Captioning {plan.job.location} with {plan.recipe.name}")

    @property
    def index(self) -> int:
        """This partition's number (0 when the run is not fanned out)."""
        return self.partition.index if self.partition else 0

    @property
    def parts_id(self) -> str:
        """Names this partition's result parts (`part-<parts_id>-<shard>.jsonl`)."""
        return partition_parts_id(self.run_id, self.partition.index) if self.partition else self.run_id
