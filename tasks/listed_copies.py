"""Copies among a fanned-out run's listed items, found by the one partition that lists the source
(tasks/shard_plan.py), before any partition fetches them:

- an item whose members' listed ETags are all MD5s (tasks/results/earlier.py) is a copy of the
  first item listed with the same (ETag, size) list: nothing is read;
- in a folder (whose listing has no content hash), the first item of a list of member sizes is
  remembered, and only when another item of the same sizes is listed are both read and hashed
  (each once), so a folder without copies is hashed nowhere but where sizes collide.

The planner puts copies in copy shards, which the partitions take only once every other shard
of the plan is done: a copy then finds its original's answer on the reloaded done-index and
makes no request, whichever partition captioned the original. Memory is bounded: the KEEP latest
distinct media are remembered; a copy of an older one is captioned like any item.
"""

from __future__ import annotations

from collections import OrderedDict

from tasks.results.done_rows import signature_hash
from tasks.results.earlier import content_signature
from tasks.results.records import group_sha256, sha256_hex
from tasks.sources.items import WorkItem
from tasks.sources.storage import LocalStorage, Storage

KEEP = 200_000  # distinct media remembered (about 150 bytes each)


class ListedCopies:
    """Says, item after item in listing order, whether an item is a copy of one listed before."""

    def __init__(self, storage: Storage | None = None):
        self.storage = storage if isinstance(storage, LocalStorage) else None  # read to hash; else ETags only
        self._firsts: OrderedDict[tuple, str] = OrderedDict()  # media identity -> the first item's key
        self._sizes: OrderedDict[tuple[int, ...], WorkItem | None] = OrderedDict()  # folder: first of these sizes
        self.found = 0

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
            self.found += 1
            return True
        self._remember(self._firsts, identity, key)
        return False

    @staticmethod
    def _remember(memory: OrderedDict, name, value) -> None:
        memory[name] = value
        if len(memory) > KEEP:
            memory.popitem(last=False)

    def _hash(self, item: WorkItem) -> tuple:
        try:
            hashes = [sha256_hex(self.storage.read(m.key)) for m in item.members]
        except OSError:  # unreadable now: not judged a copy (its fetch will say what is wrong)
            return ("unread", item.id)
        return ("sha256", hashes[0] if len(hashes) == 1 else group_sha256(hashes))
