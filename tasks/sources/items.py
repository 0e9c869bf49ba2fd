"""What the pipeline works on: listed objects, and the work items (one record set each) built from them."""

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
    """One stored object: enough to fetch it and to tell whether it changed. `key` is relative to
    the source root, or a manifest's URI or path (size and etag then unknown: -1, "");
    `last_modified` (epoch seconds, None when unknown) is what `--modified-since` compares."""

    key: str
    size: int = -1
    etag: str = ""
    last_modified: float | None = None


@dataclass(frozen=True)
class RefusedRef(ObjectRef):
    """A listed object the storage will not read (a link out of a folder): a `bad_input` record."""

    problem: str = ""


@dataclass(frozen=True)
class WorkItem:
    """One unit of output: its media (one object, or a group in order) and its own questions (empty: the job's)."""

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
    """The unit of bookkeeping: one results part, its steps and their retries."""

    index: int
    items: tuple[WorkItem, ...]


def _is_text(key: str) -> bool:
    try:
        return key.isascii() or bool(key.encode("utf-8"))  # most keys ascii, at no cost (a flag of the string)
    except UnicodeEncodeError:
        return False


def text_key(key: str) -> str:
    """`key` itself where it is text; else (a file name's bytes that are not UTF-8, decoded as lone
    surrogates, which nothing can encode) its bytes as UTF-8, each backslash doubled and each byte
    that is not UTF-8 written `\\xNN` (`odd \\xff name.jpg`): it reads back to the exact bytes."""
    if _is_text(key):
        return key
    try:
        raw = key.encode("utf-8", "surrogateescape")  # the name's own bytes
    except UnicodeEncodeError:  # a lone surrogate of another origin (a JSON escape)
        raw = key.encode("utf-8", "surrogatepass")
    return raw.replace(b"\\", b"\\\\").decode("utf-8", "backslashreplace")


def as_text(item: WorkItem) -> WorkItem:
    """The item where its id and keys are text (nearly always); else the same under its keys rendered
    by `text_key`, a final `bad_input` error saying so (its bytes never read)."""
    if _is_text(item.id) and all(_is_text(m.key) for m in item.members):
        return item
    members = tuple(dataclasses.replace(m, key=text_key(m.key)) for m in item.members)
    problem = (f"{text_key(item.id)}: the name is not valid UTF-8 (its bytes that are not are shown as \\xNN, "
               "a backslash as \\\\); rename it to caption it")
    return dataclasses.replace(item, id=text_key(item.id), members=members, problem=problem)


def annotate_records(items: Iterable[WorkItem], records: list) -> list:
    """`records` (ResultRecord) with their items' metadata (a tar sample's `.json`/`.txt`, a Parquet row's)."""
    by_id = {item.id: item for item in items if item.metadata}
    if not by_id:
        return records
    return [record.model_copy(update={"metadata": json.loads(by_id[record.key].metadata)})
            if record.key in by_id else record for record in records]
