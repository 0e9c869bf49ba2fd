"""An item being prepared whose media are the same bytes as a done result's takes that result's
answer (its record's `duplicate_of` names the item captioned), with no engine request: looked up
before the fetch where the listed ETags are MD5s (the copy is not even downloaded), else after it
by the bytes' sha256 (the copy is not decoded). The done-index finds the result
(tasks/results/done_index.py); the answer is read back from its part (tasks/results/earlier.py).
"""

from __future__ import annotations

from typing import Any

from tasks.results.done_index import DoneIndex
from tasks.results.earlier import content_signature, copied_output, original_key
from tasks.results.records import GenerationOutput, Member, ResultRecord
from tasks.settings import get_settings


def take_copies(done: DoneIndex, prepared: Any, fetched: bool = True) -> bool:
    """Fill `prepared.copies` (question -> the earlier record whose answer it takes) for the
    questions a done result answers; True when every question of the item is answered so (no
    fetch, or no decode, is needed). `prepared` is a PreparedItem (tasks/media/prepare.py)."""
    if not get_settings().dedup:
        return False
    item = prepared.item
    signature = None if fetched else content_signature(item)
    if not fetched and signature is None:
        return False
    for question in prepared.questions:
        if question not in prepared.copies:
            found = done.earlier_answer(question, sha256=prepared.sha256 if fetched else None, signature=signature)
            if found is not None:
                prepared.copies[question] = found
    every = bool(prepared.questions) and all(q in prepared.copies for q in prepared.questions)
    if every and not fetched:  # the bytes are the earlier record's: its hashes stand for them
        earlier = next(iter(prepared.copies.values()))
        hashes = [m.sha256 for m in earlier.members] if earlier.members else [earlier.sha256]
        prepared.members = [Member(key=m.key, size=m.size, etag=m.etag, sha256=h) for m, h in zip(item.members, hashes)]
        prepared.sha256 = earlier.sha256
    return every


def copy_answer(record: ResultRecord, method: str) -> tuple[GenerationOutput, str]:
    """The answer a copy takes from an earlier record, and the key it names as `duplicate_of`."""
    return copied_output(record, keep_prompt=method == "chat"), original_key(record)
