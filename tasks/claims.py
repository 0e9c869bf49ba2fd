"""How the partitions of a fanned-out run share its shards: claims in the output store, heartbeats,
and the retake of a gone partition's shards (the whole story: docs/operations.md, "Fan-out over
several GPUs"). A claim names the shard's first and last item, so that two partitions that see
other items in one shard (a lister replaced, over a source that changed) are logged.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.sources.items import Shard
from vlm_caption.tasks.sources.storage import LocalStorage, Storage

BEAT_S = 5.0
STALE_S = 30.0  # a heartbeat unchanged this long (by the watcher's clock): its partition is gone
CLAIM = re.compile(r"(\d{6})(?:\.r(\d+))?$")


def claims_prefix(run_id: str) -> str:
    return f"claims/{run_id}/"


class ShardClaims:
    """This partition's side of the run's claims (one per partition process): the ledger of who
    holds which shard, and, inside `with`, this partition's heartbeat."""

    def __init__(self, out: Storage, run_id: str, partition: int, beat_s: float = BEAT_S, stale_s: float = STALE_S,
                 partitions: int = 1):
        self.out, self.run_id, self.partition, self.partitions = out, run_id, partition, partitions
        self.owner, self.prefix, self.stale_s = f"p{partition}", claims_prefix(run_id), stale_s
        self.taken = 0  # shards this partition claimed (first claims and retakes)
        self.retaken = 0
        # A partition's heartbeat as this process last saw it, and when it last changed: (beat, when)
        self._seen: dict[str, tuple] = {}  # heartbeats read (`gone`)
        self._listed: dict[str, tuple] = {}  # heartbeats' ETags as the claims' listings showed them (`retake`)
        self._finished: set[str] = set()  # owners whose `finished-<owner>` a listing showed
        self._holders: dict[tuple[int, int], str] = {}  # (shard, generation) -> owner: a claim never changes
        self._mine: set[tuple[int, int]] = set()  # the claims this partition won
        self._waiting_since: float | None = None
        self.log = get_logger(run_id=run_id, partition=partition)
        self.beat_s, self._beats, self._stop = beat_s, 0, threading.Event()

    # ---- the heartbeat: `alive-<owner>.json` rewritten every `beat_s` seconds while the partition runs,
    # and `finished` once, however it ends: the others retake its shards at once -----------------------
    def __enter__(self) -> ShardClaims:
        self.beat("running")
        self._thread = threading.Thread(target=self._beating, name="claims-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.beat_s + 5)
        try:
            self.beat("finished")
            self.out.write(f"{self.prefix}finished-{self.owner}", b"")  # seen in a listing
        except Exception as error:  # noqa: BLE001 - they retake it once the heartbeat is stale
            self.log.warning("could not say this partition finished; others wait for its heartbeat to go stale",
                             error=str(error))

    def _beating(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self.beat("running")
            except Exception as error:  # noqa: BLE001 - a store hiccup; the next beat tries again
                self.log.warning("heartbeat not written", error=str(error))

    def beat(self, state: str) -> None:
        self._beats += 1
        body = {"beat": self._beats, "state": state, "partition": self.partition}
        self.out.write(self._alive_key(self.owner), json.dumps(body).encode())

    def _alive_key(self, owner: str) -> str:
        return f"{self.prefix}alive-{owner}.json"

    # ---- claims ---------------------------------------------------------------------------------
    def claim(self, shard: Shard, *, compare: bool = False) -> bool:
        """True if this partition now holds `shard` (it alone captions it). With `compare`, a
        shard another partition holds is checked to be the same items in its listing."""
        body = {"owner": self.owner, "partition": self.partition, "items": len(shard.items),
                "first": shard.items[0].id, "last": shard.items[-1].id}  # a listed shard is never empty
        won = self.out.create(claim_key(self.run_id, shard.index, 0), json.dumps(body).encode())
        if won:
            self.taken += 1
            self._mine.add((shard.index, 0))
        elif compare:
            self._check_same_shard(shard, body)
        return won

    def claimed(self, shards):
        """The shards of `shards` this partition wins, claimed one at a time as they are asked for.
        At a lost claim it lists the claims and skips every shard claimed by then, instead of a
        conditional write for each one the others hold."""
        taken: set[int] = set()
        compared = False
        for shard in shards:
            if not isinstance(shard, Shard):  # the items already done the listing counts: passed on
                yield shard
                continue
            if shard.index in taken:
                continue
            if self.claim(shard, compare=not compared):
                yield shard
            else:  # every shard claimed so far (by anyone), from one listing of the claims
                compared = True
                taken = {int(match[1]) for ref in self.out.iter_objects(prefix=self.prefix)
                         if (match := CLAIM.match(ref.key[len(self.prefix):]))}

    def own_share_first(self, chunk: list[Shard]) -> list[Shard]:
        """A chunk of the plan in the order this partition tries its shards: from its own share
        on (partition i of N at shard i·len/N), then round to the chunk's start."""
        start = self.partition * len(chunk) // self.partitions
        return chunk[start:] + chunk[:start]

    def done_key(self, index: int) -> str:
        """Written (by the write of the shard's part, tasks/results/writers.py) once it is done."""
        return f"{self.prefix}{index:06d}.done"

    def mark_done(self, index: int) -> None:
        self.out.write(self.done_key(index), b"")

    def _check_same_shard(self, shard: Shard, mine: dict) -> None:
        try:
            theirs = json.loads(self.out.read(claim_key(self.run_id, shard.index, 0)))
        except (OSError, ValueError) as error:
            self.log.warning("a claim could not be read back", shard=shard.index, error=str(error))
            return
        if (theirs.get("first"), theirs.get("last")) != (mine["first"], mine["last"]):
            self.log.warning("the source changed while the partitions listed it: this shard holds other items "
                             "in another partition's listing (some may be captioned twice; none is lost)",
                             shard=shard.index, ours=[mine["first"], mine["last"]],
                             theirs=[theirs.get("first"), theirs.get("last")])

    # ---- the end: wait for the others, retake what a gone partition left --------------------------
    def unfinished(self) -> dict[int, int]:
        """Claimed shards not done yet (index -> latest generation), from one listing of the claims,
        which shows the heartbeats' ETags and `finished-` marks too: while nobody is gone nothing
        else is read (a read of each claim and heartbeat a poll: seconds at 200 ms a request)."""
        latest: dict[int, int] = {}
        done: set[int] = set()
        for ref in self.out.iter_objects(prefix=self.prefix):
            name = ref.key[len(self.prefix):]
            if name.endswith(".done"):
                done.add(int(name[:6]))
            elif name.startswith("finished-"):
                self._finished.add(name[len("finished-"):])
            elif name.startswith("alive-") and name.endswith(".json"):
                _changed_at(self._listed, name[len("alive-"):-len(".json")], ref.etag)
            elif (match := CLAIM.match(name)):
                index, generation = int(match[1]), int(match[2] or 0)
                latest[index] = max(latest.get(index, 0), generation)
        return {index: generation for index, generation in latest.items() if index not in done}

    def _gone_as_listed(self, owner: str) -> bool:
        """`gone` from the listings: a `finished` mark, or no new heartbeat ETag for `stale_s`."""
        if owner == self.owner:
            return False
        since = self._listed[owner][1] if owner in self._listed else self._waiting_since or time.monotonic()
        return owner in self._finished or time.monotonic() - since >= self.stale_s

    def _holder(self, index: int, generation: int) -> str | None:
        if (index, generation) not in self._holders:
            try:
                claim = json.loads(self.out.read(claim_key(self.run_id, index, generation)))
                self._holders[(index, generation)] = claim["owner"]
            except (OSError, ValueError, KeyError) as error:  # a claim being written: seen next round
                self.log.warning("a claim could not be read", shard=index, error=str(error))
        return self._holders.get((index, generation))

    def gone(self, owner: str) -> bool:
        """Another partition said it finished, or its heartbeat has not changed for `stale_s` seconds."""
        try:
            beat = json.loads(self.out.read(self._alive_key(owner)))
        except (OSError, ValueError):
            beat = None  # it claimed before its first beat landed, or the beat is unreadable: wait
        if beat is not None and beat.get("state") == "finished":
            return True
        return time.monotonic() - _changed_at(self._seen, owner, beat) >= self.stale_s

    def retake(self) -> list[int] | None:
        """The shards of gone partitions this partition now holds (retaken); an empty list while
        other live partitions still hold shards; None once every claimed shard is done."""
        pending = self.unfinished()
        if not pending:
            return None
        self._waiting_since = self._waiting_since or time.monotonic()
        for index in [index for index, generation in pending.items() if (index, generation) in self._mine]:
            self.mark_done(index)  # captioned here (the pipeline has drained); its mark was lost
            del pending[index]
        owners = set(self._listed) | self._finished
        if not any(map(self._gone_as_listed, owners)) and time.monotonic() - self._waiting_since < self.stale_s:
            return []  # nobody is gone: no claim read
        retaken = []
        for index, generation in sorted(pending.items()):
            owner = self._holder(index, generation)
            if owner is not None and self._gone_as_listed(owner) and not self.out.exists(self.done_key(index)):
                # (done since it was listed: a holder marks its shards done, then says it finished)
                if self.out.create(claim_key(self.run_id, index, generation + 1),
                                   json.dumps({"owner": self.owner, "partition": self.partition,
                                               "retaken_from": owner}).encode()):
                    self.log.warning("a shard whose partition is gone is captioned here", shard=index, gone=owner)
                    self._mine.add((index, generation + 1))
                    retaken.append(index)
        self.taken += len(retaken)
        self.retaken += len(retaken)
        return retaken


def _changed_at(seen: dict[str, tuple], owner: str, beat) -> float:
    """When `owner`'s heartbeat last changed (by this process's clock), `beat` the one seen now."""
    if owner not in seen or seen[owner][0] != beat:
        seen[owner] = (beat, time.monotonic())
    return seen[owner][1]


def claim_key(run_id: str, index: int, generation: int) -> str:
    """Shard `index`'s claim: generation 0 the first, N its Nth retake (`.rN`)."""
    return f"{claims_prefix(run_id)}{index:06d}" + (f".r{generation}" if generation else "")


def was_retaken(out: Storage, run_id: str, index: int) -> bool:
    """Shard `index` was claimed again (`.r1`) from a partition that was gone: its retaker counted
    its items (flows/caption.py counts a dead partition's parts, the others' from its report)."""
    return out.exists(claim_key(run_id, index, 1))


def remove_claims(out: Storage, run_id: str) -> int:
    """Delete the run's claims, done marks, heartbeats and shard plan once it has finished.
    Best effort: what is left is a few bytes a shard, and names no later run reads."""
    removed = 0
    for ref in list(out.iter_objects(prefix=claims_prefix(run_id))):
        try:
            out.delete(ref.key)
            removed += 1
        except Exception as error:  # noqa: BLE001 - left behind, logged; the run's results do not depend on it
            get_logger(run_id=run_id).warning("a claim was not removed", key=ref.key, error=str(error))
    if isinstance(out, LocalStorage):  # a folder's claims/<run_id>/plan/ and claims/<run_id>/, now empty
        for folder in (out.root / claims_prefix(run_id) / "plan", out.root / claims_prefix(run_id)):
            with contextlib.suppress(OSError):  # not empty (a partition still writing): left as it is
                folder.rmdir()
    return removed
