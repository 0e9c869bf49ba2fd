"""What the pipeline works on: listed objects, and the work items (one record set each) built
from them: one object (image, video), one folder of images (a group), or one manifest line."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass


class BadInput(ValueError):
    """An item's own problem (damaged, empty, not media, a name or link refused): its records are
    final `bad_input` errors naming it; a rerun would only repeat it."""


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
class RefusedRef(ObjectRef):
    """A listed object the storage will not read (a link leading out of a folder source): its
    item is a `bad_input` record saying why, made from the listing alone."""

    problem: str = ""


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


def _is_text(key: str) -> bool:
    try:
        return key.isascii() or bool(key.encode("utf-8"))  # most keys ascii, at no cost (a flag of the string)
    except UnicodeEncodeError:
        return False


def text_key(key: str) -> str:
    """`key` itself where it is text; else a reversible rendering of its bytes. A folder's names
    and a tar's member names arrive as Python decodes file names (bytes that are not UTF-8 as lone
    surrogates, `surrogateescape`), which no hash, JSON record, Parquet cell or page can encode:
    such a key becomes its bytes as UTF-8 with each backslash doubled and each byte that is not
    UTF-8 written `\\xNN` (`odd \\xff name.jpg`), which reads back to the exact bytes."""
    if _is_text(key):
        return key
    try:
        raw = key.encode("utf-8", "surrogateescape")  # the name's own bytes
    except UnicodeEncodeError:  # a lone surrogate of another origin (a JSON escape)
        raw = key.encode("utf-8", "surrogatepass")
    return raw.replace(b"\\", b"\\\\").decode("utf-8", "backslashreplace")


def as_text(item: WorkItem) -> WorkItem:
    """The item where its id and keys are text (nearly always: itself); else the same item under
    its keys rendered by `text_key`, a final `bad_input` error saying so (its bytes are never read:
    a key that is not text cannot be recorded, looked up or shown faithfully)."""
    if _is_text(item.id) and all(_is_text(m.key) for m in item.members):
        return item
    members = tuple(dataclasses.replace(m, key=text_key(m.key)) for m in item.members)
    problem = (f"{text_key(item.id)}: the name is not valid UTF-8 (its bytes that are not are shown as \\xNN, "
               "a backslash as \\\\); rename it to caption it")
    return dataclasses.replace(item, id=text_key(item.id), members=members, problem=problem)


def annotate_records(items: Iterable[WorkItem], records: list) -> list:
    """`records` (ResultRecord) with their items' metadata: a WebDataset sample's `.json`/`.txt` or
    a Parquet row's other columns. (Damage the listing found is the reader's `read` to raise.)"""
    by_id = {item.id: item for item in items if item.metadata}
    if not by_id:
        return records
    return [record.model_copy(update={"metadata": json.loads(by_id[record.key].metadata)})
            if record.key in by_id else record for record in records]
