"""Same media captioned once (`CaptionJob.dedup`; docs/operations.md, "Caption checks, copies and
what a run cost"): an (item, question) whose media are the same bytes as one already asked takes
that answer with no engine request, its record's `duplicate_of` naming the key of the item
captioned. Found in the run's process by the fetched bytes' sha256 (`SAME_MEDIA`), from a done
result by the done-index (`take_copies`: before the fetch by listed MD5 ETags, else after it), and
across a fanned-out run's partitions by its lister (`ListedCopies`), into copy shards.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from vlm_caption.tasks.results.done_index import DoneIndex
from vlm_caption.tasks.results.done_rows import Signature, listing_signature, signature_hash
from vlm_caption.tasks.records import GenerationOutput, Member, ResultRecord, group_sha256, sha256_hex
from vlm_caption.tasks.sources.items import WorkItem
from vlm_caption.tasks.sources.storage import LocalStorage, Storage

MD5 = re.compile(r"[0-9a-f]{32}")
KEEP_RUNS = 2  # runs whose answers are kept (a worker runs one at a time; a second may be starting)
KEEP_ANSWERS = 50_000  # answers kept per run, the latest (about a kilobyte each)
KEEP_LISTED = 200_000  # distinct media the lister remembers (about 150 bytes each)


def content_signature(item: WorkItem) -> Signature | None:
    """The listed (ETag, size) of each member where every ETag is the object's MD5, else None."""
    signature = listing_signature(item)
    if signature is None or not all(MD5.fullmatch(etag.lower()) for etag, _ in signature):
        return None
    return signature


def take_copies(done: DoneIndex, prepared: Any, fetched: bool = True) -> bool:
    """Fill `prepared.copies` (question -> the done record whose answer it takes) from `done`;
    True when every question of the item is answered so (no fetch, or no decode, is needed).
    `prepared` is a PreparedItem (tasks/prepare.py)."""
    signature = None if fetched else content_signature(prepared.item)
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
        prepared.members = [Member(key=m.key, size=m.size, etag=m.etag, sha256=h)
                            for m, h in zip(prepared.item.members, hashes)]
        prepared.sha256 = earlier.sha256
    return every


def copied(record: ResultRecord, keep_prompt: bool) -> tuple[GenerationOutput, str]:
    """A done record's answer as the engine gave it (a generate prompt is rendered again), and the
    key of the item captioned (a copy's record names the one it took its answer from)."""
    return (GenerationOutput(record.text, record.finish_reason, record.prompt_tokens, record.output_tokens,
                             prompt=record.prompt if keep_prompt else None), record.duplicate_of or record.key)


class CopyWithoutAnswer(RuntimeError):
    """The shard of the item a copy waited on failed (the copy's shard is retried)."""


class Claim(Future):
    """One (media, question) of a run: the first item's key, and the future of its answer."""

    def __init__(self, key: str):
        super().__init__()
        self.key = key


class SameMedia:
    """The answers of a process's runs by (media, question)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: OrderedDict[str, OrderedDict[tuple[str, str], Claim]] = OrderedDict()

    def answers(self, run_id: str | None, pairs: list[tuple[Any, str]], ask: Callable[[list], list[GenerationOutput]],
                media_id: Callable[[Any], str], keep_prompt: bool) -> dict[tuple[int, str], tuple[Any, str | None]]:
        """By (id(item), question), each pair's answer and the key of the item it took it from
        (None: `ask`ed here): a done result's (the item's `copies`), else with a `run_id` the run's
        first of these bytes and question (in this shard, or waited for in another), else `ask`'s;
        an item with an error has none. A generate prompt is not taken: a copy renders its own."""
        found = {(id(item), q): copied(item.copies[q], keep_prompt) for item, q in pairs if q in item.copies}
        pairs = [(item, q) for item, q in pairs if q not in item.copies and item.error is None]
        claims = {} if run_id is None else {(id(item), q): self.claim(run_id, media_id(item), q, item.item.id)
                                            for item, q in pairs if item.sha256}
        asked = [(item, q) for item, q in pairs if claims.get((id(item), q), (None, True))[1]]
        try:
            outputs = ask(asked)
        except BaseException as exc:  # the copies waiting on these answers raise too
            self.forget(run_id, [(media_id(item), q) for item, q in asked if (id(item), q) in claims], exc)
            raise
        for (item, q), out in zip(asked, outputs):
            found[(id(item), q)] = (out, None)
            if (id(item), q) in claims:
                claims[(id(item), q)][0].set_result(out if keep_prompt else replace(out, prompt=None))
        found.update({pair: (self.answer(claim), claim.key) for pair, (claim, first) in claims.items() if not first})
        return found

    def claim(self, run_id: str, media: str, question: str, key: str) -> tuple[Claim, bool]:
        """The run's claim on these bytes and question, and whether the caller is its first: the
        first asks the engine, then sets its result or forgets it; the others wait for its `answer`."""
        with self._lock:
            claims = self._runs.get(run_id)
            if claims is None:
                claims = self._runs[run_id] = OrderedDict()
                while len(self._runs) > KEEP_RUNS:
                    self._runs.popitem(last=False)  # a waiter holds its own claim: nothing hangs
            found = claims.get((media, question))
            if found is not None:
                return found, False
            made = claims[(media, question)] = Claim(key)
            if len(claims) > KEEP_ANSWERS:
                claims.popitem(last=False)  # its waiters hold the claim itself, and are still answered
            return made, True

    def forget(self, run_id: str, media_questions: list[tuple[str, str]], error: BaseException) -> None:
        """The first ones' shard failed: their copies raise `error` (their shard is retried and
        asks the engine itself), and the next (item, question) with these bytes is a first."""
        with self._lock:
            claims = self._runs.get(run_id, {})
            dropped = [claims.pop(mq, None) for mq in media_questions]
        for claim in dropped:
            if claim is not None and not claim.done():
                claim.set_exception(error)

    @staticmethod
    def answer(claim: Claim) -> GenerationOutput:
        """The first one's answer, waited for while its shard is in the engine."""
        error = claim.exception()
        if error is not None:
            raise CopyWithoutAnswer(f"{claim.key}, whose answer this item takes, failed: "
                                    f"{type(error).__name__}: {error}") from error
        return claim.result()


SAME_MEDIA = SameMedia()


class ListedCopies:
    """Says, item after item in listing order, whether an item is a copy of one listed before;
    `storage` a folder's, whose items of equal sizes are read to be hashed (else ETags only)."""

    def __init__(self, storage: Storage | None = None):
        self.storage = storage if isinstance(storage, LocalStorage) else None
        self._firsts: OrderedDict[tuple, str] = OrderedDict()  # media identity -> the first item's key
        self._sizes: OrderedDict[tuple[int, ...], WorkItem | None] = OrderedDict()  # folder: first of these sizes

    def is_copy(self, item: WorkItem) -> bool:
        if item.problem is not None or item.questions:  # a damaged item, a manifest line's own questions
            return False
        signature = content_signature(item)
        if signature is not None:
            return self._seen(("etag", signature_hash(signature)), item.id)
        sizes = tuple(m.size for m in item.members)
        if self.storage is None or not sizes or min(sizes) < 0:
            return False
        if sizes not in self._sizes:  # the first of these sizes: hashed only if another comes
            self._remember(self._sizes, sizes, item)
            return False
        first = self._sizes[sizes]
        if first is not None:
            self._sizes[sizes] = None  # hashed from now on
            self._seen(self._hash(first), first.id)
        return self._seen(self._hash(item), item.id)

    def _seen(self, identity: tuple, key: str) -> bool:
        if identity in self._firsts:
            return True
        self._remember(self._firsts, identity, key)
        return False

    @staticmethod
    def _remember(memory: OrderedDict, name, value) -> None:
        memory[name] = value
        if len(memory) > KEEP_LISTED:
            memory.popitem(last=False)

    def _hash(self, item: WorkItem) -> tuple:
        try:
            hashes = [sha256_hex(self.storage.read(m.key)) for m in item.members]
        except OSError:  # unreadable now: not judged a copy (its fetch will say what is wrong)
            return ("unread", item.id)
        return ("sha256", hashes[0] if len(hashes) == 1 else group_sha256(hashes))
