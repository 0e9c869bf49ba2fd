"""The result record written per (work item, question), and the identity of a result set."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True)
class ItemError:
    kind: str  # fetch | decode | too_large | too_many_images | generate | unsupported | structured_output | bad_input
    message: str
    # Retryable errors (a network blip) are retried by the next run; the others are final.
    retryable: bool = False


@dataclass(frozen=True)
class GenerationOutput:
    text: str | None
    finish_reason: str | None
    prompt_tokens: int
    output_tokens: int
    error: str | None = None
    prompt: str | None = None  # the rendered prompt, where vLLM rendered it (the chat method)


class Member(BaseModel):
    """One object of an item (the only one for an image or video; each image of a group)."""

    key: str
    size: int
    etag: str
    sha256: str | None = None


class ResultRecord(BaseModel):
    """One result record per (work item, question): a row of the results' Parquet files."""

    model_config = ConfigDict(extra="ignore")

    key: str  # the item: an object key, a group's folder, or a manifest line's id
    size: int
    etag: str
    sha256: str | None  # of the object; for a group, of its members' hashes in order
    recipe: str
    model: str
    question: str | None = None
    prompt: str | None
    text: str | None
    finish_reason: str | None
    structured: Any = None  # a json_schema job's answer, parsed and validated
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: dict[str, Any] | None = None
    members: list[Member] | None = None  # a group's or a manifest line's objects, in order
    video: dict[str, Any] | None = None  # frames, duration_s, fps, width, height
    metadata: dict[str, Any] | None = None  # a WebDataset sample's .json/.txt, a Parquet row's other columns
    # Caption checks (tasks/results/quality.py): looping, empty, truncated, schema; None when fine.
    quality: list[str] | None = None
    # The first answer's flags where it was asked again with other sampling (the job's `retry_looping`);
    # `text` and `quality` are then the better of the two answers.
    retried_for: list[str] | None = None
    # The key of the item (of this run or an earlier one) whose answer this record took: the same
    # bytes, asked the same question, captioned once (tasks/same_media.py); its tokens are then 0.
    duplicate_of: str | None = None
    timings: dict[str, float]
    fingerprint: str
    run_id: str

    @property
    def is_final(self) -> bool:
        """Done for good: a caption, or an error that a rerun would only repeat."""
        return self.error is None or not self.error.get("retryable", False)


def job_fingerprint(*, source: str, recipe: str, model: str, modality: str, method: str,
                    media: dict[str, Any], sampling: dict[str, Any], structured: dict[str, Any] | None = None,
                    retry_looping: float | None = None, dedup: bool = True) -> str:
    """What makes two results interchangeable: same source (record keys are relative to it), recipe,
    model, modality, method, media sampling and sampling parameters, and whatever else changes the
    records (a structured-output constraint, the re-ask of looping captions, `dedup` off), each left
    out at its default so that a job's fingerprint is what it was before it existed. Not the question:
    each record carries its own, so a question added later computes only that one."""
    fields = {"source": source.rstrip("/"), "recipe": recipe, "model": model, "modality": modality,
              "method": method, "media": media, "sampling": sampling}
    given = {"structured": structured, "retry_looping": retry_looping, "dedup": None if dedup else False}
    fields.update((name, value) for name, value in given.items() if value is not None)
    return sha256_hex(json.dumps(fields, sort_keys=True).encode())[:16]


def structured_answer(text: str | None, finish_reason: str | None,
                      schema: dict[str, Any]) -> tuple[Any, ItemError | None]:
    """A json_schema job's answer: the text parsed and checked against the schema, or why not
    (the engine's grammar guarantees the form of a completed answer, not of one cut short)."""
    from jsonschema import Draft202012Validator

    cut = " (cut at max_tokens: raise sampling.max_tokens)" if finish_reason == "length" else ""
    try:
        value = json.loads(text or "")
    except json.JSONDecodeError as exc:
        return None, ItemError("structured_output", f"answer is not valid JSON{cut}: {exc}")
    problem = next(iter(Draft202012Validator(schema).iter_errors(value)), None)
    if problem is not None:
        where = "/".join(str(p) for p in problem.absolute_path)
        return None, ItemError("structured_output", f"answer does not match the JSON schema{cut}: "
                               f"{problem.message}" + (f" (at {where})" if where else ""))
    return value, None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def group_sha256(member_hashes: list[str | None]) -> str | None:
    """A group's content identity: its members' hashes in order (adding one makes a new item)."""
    if not member_hashes or any(h is None for h in member_hashes):
        return None
    return sha256_hex("\n".join(member_hashes).encode())
