"""What earlier runs with the same fingerprint finished, so a rerun computes only the rest.

A result is identified by (item key, question). Before fetching, an item whose every question
is done for the same members (etag and size) is skipped; after fetching, one whose content hash
matches (re-uploaded, same bytes) is skipped too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefect import task
from prefect.cache_policies import NONE
from pydantic import ValidationError

from tasks.observability import get_logger
from tasks.results.layout import results_prefix
from tasks.results.records import ResultRecord
from tasks.sources.items import WorkItem
from tasks.sources.storage import open_storage


@dataclass(frozen=True)
class DoneEntry:
    signature: tuple[tuple[str, int], ...]  # (etag, size) of each member, in order
    sha256: str | None


def listing_signature(item: WorkItem) -> tuple[tuple[str, int], ...] | None:
    """(etag, size) per member, or None when a member's were not listed (manifest URLs)."""
    if any(not m.etag or m.size < 0 for m in item.members):
        return None
    return tuple((m.etag, m.size) for m in item.members)


def record_signature(record: ResultRecord) -> tuple[tuple[str, int], ...]:
    members = record.members or [record]
    return tuple((m.etag, m.size) for m in members)


@dataclass
class DoneIndex:
    entries: dict[tuple[str, str | None], DoneEntry] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, record: ResultRecord) -> None:
        self.entries[(record.key, record.question)] = DoneEntry(record_signature(record), record.sha256)

    def pending_by_listing(self, item: WorkItem, questions: tuple[str, ...]) -> tuple[str, ...]:
        """The questions still to compute, judged from the listing alone (no fetch)."""
        signature = listing_signature(item)
        if signature is None:
            return questions
        return tuple(q for q in questions
                     if (entry := self.entries.get((item.id, q))) is None or entry.signature != signature)

    def pending_by_content(self, item_id: str, sha256: str | None,
                           questions: tuple[str, ...]) -> tuple[str, ...]:
        """Of those, the ones whose result is not there for these very bytes."""
        return tuple(q for q in questions
                     if sha256 is None or (entry := self.entries.get((item_id, q))) is None
                     or entry.sha256 != sha256)


@task(name="load-done-index", cache_policy=NONE, persist_result=False, retries=2)
def load_done_index(output_uri: str, fingerprint: str) -> DoneIndex:
    """Results that earlier runs with this fingerprint finished for good (captioned, or failed
    in a way a rerun would only repeat). A part that cannot be read is skipped with a warning
    naming it; its items are computed again."""
    out = open_storage(output_uri, create=True)
    done = DoneIndex()
    log = get_logger(fingerprint=fingerprint)
    for part in out.iter_objects(glob="*.jsonl", prefix=results_prefix(fingerprint)):
        try:
            lines = out.read(part.key).decode("utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("unreadable results part skipped", part=out.describe(part.key), error=str(exc))
            continue
        bad = 0
        for line in lines:
            if not line.strip():
                continue
            try:
                record = ResultRecord.model_validate_json(line)
            except ValidationError:
                bad += 1
                continue
            if record.is_final:
                done.add(record)
        if bad:
            log.warning("results part has lines that are not records; they are ignored",
                        part=out.describe(part.key), bad_lines=bad)
    return done
