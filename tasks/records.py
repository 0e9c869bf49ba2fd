"""The types that pass between tasks, and the result record written per input object."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True)
class ObjectRef:
    """One listed object: enough to fetch it and to tell whether it changed."""

    key: str
    size: int
    etag: str


@dataclass(frozen=True)
class Shard:
    index: int
    objects: tuple[ObjectRef, ...]


@dataclass(frozen=True)
class ItemError:
    kind: str  # fetch | decode | too_large | generate | unsupported
    message: str
    # Retryable errors (a network blip) are retried by the next run; the others are final.
    retryable: bool = False


@dataclass
class PreparedItem:
    """A fetched object: its decoded media, or the error that stopped it."""

    ref: ObjectRef
    sha256: str | None = None
    media: Any = None  # PIL.Image for images
    error: ItemError | None = None
    fetch_s: float = 0.0
    decode_s: float = 0.0


@dataclass
class PreparedShard:
    shard: Shard
    items: list[PreparedItem] = field(default_factory=list)
    skipped: int = 0  # already done by an earlier run with the same fingerprint


@dataclass(frozen=True)
class GenerationOutput:
    text: str | None
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    error: str | None = None


class ResultRecord(BaseModel):
    """One JSON Lines record per input object."""

    model_config = ConfigDict(extra="ignore")

    key: str
    size: int
    etag: str
    sha256: str | None
    recipe: str
    model: str
    prompt: str | None
    text: str | None
    finish_reason: str | None
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: dict[str, Any] | None = None
    timings: dict[str, float]
    fingerprint: str
    run_id: str

    @property
    def is_final(self) -> bool:
        """Done for good: a caption, or an error that a rerun would only repeat."""
        return self.error is None or not self.error.get("retryable", False)


def job_fingerprint(*, source: str, recipe: str, model: str, question: str, sampling: dict[str, Any]) -> str:
    """What makes two results interchangeable: same source, recipe, model, prompt and sampling.

    The source is part of it because record keys are relative to it: two prefixes that both
    hold `a.jpg` and write to one output must not count as each other's work."""
    payload = json.dumps(
        {"source": source.rstrip("/"), "recipe": recipe, "model": model, "question": question,
         "sampling": sampling},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def partition_of(key: str, count: int) -> int:
    """A stable partition for an object key: every run (and every host) agrees on it."""
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") % count


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
