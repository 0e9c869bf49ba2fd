"""One listing per fanned-out run: the shard plan that the partitions share through the output store,
in `claims/<run_id>/plan/` (its layout and the lister's replacement: docs/operations.md, "Fan-out over
several GPUs"). A copy shard's line is `[index, items, 1]`; copy shards (tasks/same_media.py) are taken
last, once every other shard of the plan is done (`originals_done`), so each copy finds its original's answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

from vlm_caption.tasks.claims import ShardClaims, claims_prefix
from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.same_media import ListedCopies
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.items import ObjectRef, Shard, WorkItem
from vlm_caption.tasks.sources.listing import AlreadyDone, Listed, PendingMask, ShardStream, StreamClosed
from vlm_caption.tasks.sources.storage import Storage

CHUNK_SHARDS = 16  # shards per chunk, at most
CHUNK_S = 1.0  # a chunk is written at least this often while there is something to say
POLL_S = 0.5  # how often a partition waiting for the next chunk lists the plan


def plan_prefix(run_id: str) -> str:
    return f"{claims_prefix(run_id)}plan/"


def chunk_name(chunk: int) -> str:  # under plan_prefix
    return f"{chunk:06d}.jsonl"


def _item_json(item: WorkItem) -> list:
    return [item.id, [[m.key, m.size, m.etag] for m in item.members], list(item.questions), item.metadata,
            item.problem]


def _item(row: list) -> WorkItem:
    key, members, questions, metadata, problem = row
    return WorkItem(key, tuple(ObjectRef(*m) for m in members), tuple(questions), metadata, problem)


class PlanWriter(ShardStream):
    """The lister's listing: what it hands over goes into the plan's chunks, not to a queue."""

    def __init__(self, out: Storage, run_id: str, owner: str, source: SourceSpec, shard_size: int,
                 limit: int | None, pending: PendingMask, resume: dict | None = None,
                 on_end: Callable[[str | None], None] | None = None, dedup: bool = True):
        resume = resume or {}
        super().__init__(source, shard_size, limit, pending=pending, first_shard=resume.get("next_shard", 0),
                         skip_items=resume.get("listed", 0), on_end=on_end)
        self.out, self.run_id, self.owner = out, run_id, owner
        self.chunk = resume.get("next_chunk", 0)
        self._shards: list[Shard] = []
        self.copies = ListedCopies(source.storage if source.format == "files" else None) if dedup else None
        self._copy_batch: list[WorkItem] = []
        self._copy_shards: set[int] = set()
        self._done = 0
        self._written_at = time.monotonic()

    def put(self, thing) -> None:
        if self._closed.is_set():
            raise StreamClosed
        if thing is None:
            self._write_chunk()
            self._create("end.json", {"chunks": self.chunk, "shards": self.shards_listed,
                                      "listed": self.items_listed, "owner": self.owner})
            return
        if isinstance(thing, BaseException):
            self._create("failed.json", {"error": f"{type(thing).__name__}: {thing}", "owner": self.owner})
            return
        if isinstance(thing, AlreadyDone):
            self._done += thing.items
        else:
            self._shards.append(thing)
        if len(self._shards) >= CHUNK_SHARDS or time.monotonic() - self._written_at >= CHUNK_S:
            self._write_chunk()

    def _take(self, items: list[WorkItem]) -> None:
        """Items with work left, in listing order: a copy of one listed before goes to a copy shard."""
        for item in items:
            if self.copies is None or not self.copies.is_copy(item):
                super()._take([item])
                continue
            self._copy_batch.append(item)
            self.items_listed += 1
            if len(self._copy_batch) == self.shard_size:
                self.put(self._copy_shard())

    def _copy_shard(self) -> Shard:
        shard = Shard(self.shards_listed, tuple(self._copy_batch))
        self.shards_listed, self._copy_batch = self.shards_listed + 1, []
        self._copy_shards.add(shard.index)
        return shard

    def _write_chunk(self) -> None:
        if self._copy_batch:  # in this chunk, so that the items its header counts are all in the plan
            self._shards.append(self._copy_shard())
        if not self._shards and not self._done:
            return
        # Items listed through this chunk: those of a shard still being filled come in the next.
        listed = self.items_listed - len(self._batch)
        header = {"owner": self.owner, "done": self._done, "listed": listed, "next_shard": self.shards_listed}
        lines = [json.dumps(header)] + [json.dumps([s.index, [_item_json(i) for i in s.items]]
                                                   + ([1] if s.index in self._copy_shards else [])) for s in self._shards]
        self._create(chunk_name(self.chunk), {}, "\n".join(lines).encode())
        self.chunk += 1
        self._shards, self._done, self._written_at = [], 0, time.monotonic()

    def _create(self, name: str, body: dict, data: bytes | None = None) -> None:
        """A conditional write: a lister that was replaced meanwhile stops, it never overwrites."""
        if not self.out.create(plan_prefix(self.run_id) + name, data if data is not None else json.dumps(body).encode()):
            raise StreamClosed


class SharedListing:
    """A partition's shards from the run's plan (listing the source itself when it wins the plan):
    `shards` "originals" (the plan's shards but its copy shards, and the items already done the
    lister counted), "copies" (its copy shards only) or "all" (every shard: to retake some)."""

    def __init__(self, out: Storage, run_id: str, claims: ShardClaims, source: SourceSpec, shard_size: int,
                 limit: int | None, pending: PendingMask, poll_s: float = POLL_S, shards: str = "originals",
                 on_end: Callable[[str | None], None] | None = None, dedup: bool = True):
        self.out, self.run_id, self.claims, self.poll_s = out, run_id, claims, poll_s
        self.shards = shards
        self.copy_shards: set[int] = set()  # the plan's copy shards, as far as it was read
        self.shard_count = 0  # shards in the plan, once its end was read
        self.prefix = plan_prefix(run_id)
        self._listing = dict(source=source, shard_size=shard_size, limit=limit, pending=pending, on_end=on_end,
                             dedup=dedup)
        self.writer: PlanWriter | None = None
        self.lists = False  # this partition listed (some of) the source
        self.log = get_logger(run_id=run_id, partition=claims.partition)

    def start(self, resume: dict | None = None, generation: int = 0) -> SharedListing:
        name = "lister" + (f".r{generation}" if generation else "")
        if self.out.create(self.prefix + name, json.dumps({"owner": self.claims.owner}).encode()):
            if generation:
                self.log.warning("the partition listing the source is gone; this one lists the rest", resume=resume)
            self.writer = PlanWriter(self.out, self.run_id, self.claims.owner, resume=resume, **self._listing)
            self.writer.start()
            self.lists = True
        return self

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def __iter__(self) -> Iterator[Listed]:
        chunk, header, names = 0, None, set()
        while True:
            if chunk_name(chunk) not in names:  # one listing of the plan says which chunks are there
                names = {ref.key[len(self.prefix):] for ref in self.out.iter_objects(prefix=self.prefix)}
            if chunk_name(chunk) in names:
                header, shards = self._read(chunk)
                if header["owner"] == self.claims.owner and header["done"] and self.shards == "originals":
                    yield AlreadyDone(header["done"])
                for shard in self.claims.own_share_first(shards):  # partitions spread over the chunk
                    if self.shards == "all" or (shard.index in self.copy_shards) == (self.shards == "copies"):
                        yield shard
                chunk += 1
                continue
            if "failed.json" in names:
                failed = json.loads(self.out.read(self.prefix + "failed.json"))
                raise RuntimeError(f"listing the source failed (partition {failed['owner']}): {failed['error']}")
            if "end.json" in names:
                end = json.loads(self.out.read(self.prefix + "end.json"))
                if end["chunks"] <= chunk:
                    self.shard_count = end["shards"]
                    return
                continue  # the last chunks landed after this listing of the plan
            self._replace_a_gone_lister(names, chunk, header)
            time.sleep(self.poll_s)

    def _read(self, chunk: int) -> tuple[dict, list[Shard]]:
        lines = self.out.read(self.prefix + chunk_name(chunk)).decode().splitlines()
        shards = []
        for index, items, *copies in map(json.loads, lines[1:]):
            shards.append(Shard(index, tuple(_item(row) for row in items)))
            if copies:
                self.copy_shards.add(index)
        return json.loads(lines[0]), shards

    def originals_done(self) -> bool:
        """Every shard of the plan but its copy shards is done (read through: `shard_count` known)."""
        prefix = self.claims.prefix
        done = {int(ref.key[len(prefix):][:6]) for ref in self.out.iter_objects(prefix=prefix)
                if ref.key.endswith(".done")}
        return all(index in done for index in range(self.shard_count) if index not in self.copy_shards)

    def _replace_a_gone_lister(self, names: set[str], chunk: int, header: dict | None) -> None:
        listers = {int(name.rsplit(".r", 1)[1]) if ".r" in name else 0: name for name in names
                   if name.startswith("lister")}  # generation: name
        if not listers:
            return  # the lister's claim is being written
        latest = max(listers)
        try:
            owner = json.loads(self.out.read(self.prefix + listers[latest]))["owner"]
        except (OSError, ValueError, KeyError):
            return  # seen next round
        if owner == self.claims.owner or not self.claims.gone(owner):
            return
        resume = {"next_chunk": chunk, "listed": (header or {}).get("listed", 0),
                  "next_shard": (header or {}).get("next_shard", 0)}
        self.close()
        self.start(resume, latest + 1)
