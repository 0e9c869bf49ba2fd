"""What the pipeline works on: listed objects, and the work items (one record set each) built
from them: one object (image, video), one folder of images (a group), or one manifest line."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ObjectRef:
    """One stored object: enough to fetch it and to tell whether it changed.

    `key` is relative to the source root for listed objects. A manifest line may also name a
    full URI (s3://, http(s)://) or a local path; its size and etag are then unknown (-1, "")
    until fetched, and resume compares content hashes instead. `last_modified` (epoch seconds,
    from the listing or an inventory report; None when unknown) is what `--modified-since`
    compares (tasks/sources/watermark.py)."""

    key: str
    size: int = -1
    etag: str = ""
    last_modified: float | None = None


@dataclass(frozen=True)
class WorkItem:
    """One unit of output: its media (one object, or a group in order) and, for a manifest
    line, its own questions (empty: the job's questions)."""

    id: str
    members: tuple[ObjectRef, ...]
    questions: tuple[str, ...] = ()
    # A WebDataset sample's .json/.txt or a Parquet row's other columns, as JSON (kept in the record).
    metadata: str | None = None
    # What the listing found wrong with it (a tar cut short, an empty cell): its records are
    # `bad_input` errors, final, so the item is never silently dropped nor retried for nothing.
    problem: str | None = None

    @property
    def size(self) -> int:
        return sum(max(m.size, 0) for m in self.members)


@dataclass(frozen=True)
class Shard:
    """The unit of bookkeeping: one results part, its steps and their retries (a batch of them is a Prefect task run)."""

    index: int
    items: tuple[WorkItem, ...]

