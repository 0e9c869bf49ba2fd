"""The partitions of a fan-out share the shards through claims in the output store
(tasks/claims.py): each shard is won by exactly one partition, a slow or late partition takes
fewer, and the shards of a partition that is gone are retaken, on a folder and on S3 (moto's
server, conditional PUTs over real HTTP)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from vlm_caption.tasks.claims import ShardClaims
from vlm_caption.tasks.sources.items import ObjectRef, Shard, WorkItem
from vlm_caption.tasks.sources.storage import LocalStorage, open_storage


def shards(count: int, size: int = 4) -> list[Shard]:
    return [Shard(i, tuple(WorkItem(f"{i:03d}-{j}.jpg", (ObjectRef(f"{i:03d}-{j}.jpg", 1, "e"),))
                          for j in range(size))) for i in range(count)]


@pytest.fixture(params=["folder", "s3"])
def store(request, tmp_path):
    if request.param == "folder":
        return LocalStorage(tmp_path / "out", create=True)
    s3_client = request.getfixturevalue("s3_client")
    request.getfixturevalue("s3_settings")
    s3_client.create_bucket(Bucket="claims")
    return open_storage("s3://claims/out/")


@pytest.fixture
def s3_settings(s3_endpoint, monkeypatch):
    from vlm_caption.tasks.settings import get_settings

    monkeypatch.setenv("VLM_CAPTION_S3_ENDPOINT_URL", s3_endpoint)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_create_is_won_by_exactly_one_writer(store):
    results = []
    barrier = threading.Barrier(8)

    def race(i):
        barrier.wait()
        results.append((i, store.create("claims/x/000001", f"writer {i}".encode())))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [i for i, won in results if won]
    assert len(winners) == 1
    assert store.read("claims/x/000001") == f"writer {winners[0]}".encode()


def test_a_slow_partition_takes_fewer_shards_and_every_shard_is_done_once(store):
    """Two partitions list the same 40 shards; one captions a shard in 20 ms, the other in 120 ms
    and starts 200 ms late (its engine came up later). Each shard is captioned once; the fast one
    takes most; both finish within a shard's time of each other."""
    listing = shards(40)
    captioned: list[tuple[int, int]] = []
    finished: dict[int, float] = {}

    def partition(index: int, per_shard_s: float, late_s: float):
        time.sleep(late_s)
        with ShardClaims(store, "run1", index, beat_s=0.2) as claims:
            for shard in claims.claimed(listing):
                time.sleep(per_shard_s)
                captioned.append((index, shard.index))
                claims.mark_done(shard.index)
            while (retaken := claims.retake()) is not None:
                assert retaken == []  # nobody is gone
                time.sleep(0.05)
        finished[index] = time.monotonic()

    threads = [threading.Thread(target=partition, args=args) for args in ((0, 0.02, 0.0), (1, 0.12, 0.2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(shard for _, shard in captioned) == list(range(40))  # every shard once
    per_partition = Counter(index for index, _ in captioned)
    assert per_partition[0] > 2 * per_partition[1] > 0, per_partition
    assert abs(finished[0] - finished[1]) < 0.5


def test_the_shards_of_a_partition_that_is_gone_are_retaken_once(store):
    listing = shards(6)
    dead = ShardClaims(store, "run2", 1, beat_s=0.1, stale_s=0.5)
    dead.beat("running")  # it beat once, claimed two shards, finished one and died (no `finished`)
    assert dead.claim(listing[0]) and dead.claim(listing[1])
    dead.mark_done(0)

    survivors = [ShardClaims(store, "run2", i, beat_s=0.1, stale_s=0.5) for i in (0, 2)]
    for claims in survivors:
        claims.__enter__()
    try:
        for claims in survivors:
            list(claims.claimed(listing))  # the rest are split between the two live ones
        for index in range(2, 6):  # the survivors captioned theirs
            store.write(f"claims/run2/{index:06d}.done", b"")
        deadline = time.monotonic() + 10
        retaken: dict[int, list[int]] = {0: [], 2: []}
        waiting = set(retaken)
        while waiting and time.monotonic() < deadline:
            for claims in survivors:
                if claims.partition not in waiting:
                    continue
                got = claims.retake()
                if got is None:
                    waiting.discard(claims.partition)
                for index in got or []:
                    retaken[claims.partition].append(index)
                    claims.mark_done(index)
            time.sleep(0.1)
        assert not waiting
        assert sorted(retaken[0] + retaken[2]) == [1]  # the unfinished one, by one survivor only
        assert store.exists("claims/run2/000001.r1") and not store.exists("claims/run2/000001.r2")
    finally:
        for claims in survivors:
            claims.__exit__(None, None, None)


def test_a_partition_that_says_it_finished_is_not_waited_for():
    from vlm_caption.tasks.sources.storage import LocalStorage as Local
    import tempfile

    store = Local(tempfile.mkdtemp(), create=True)
    listing = shards(2)
    with ShardClaims(store, "run3", 1, beat_s=60, stale_s=3600) as quitter:
        assert quitter.claim(listing[0])
    # it ended (an engine that failed to start) with its shard unfinished: retaken at once
    other = ShardClaims(store, "run3", 0, stale_s=3600)
    assert other.retake() == [0]



def test_a_partition_waiting_on_live_holders_lists_the_claims_and_reads_nothing(tmp_path, monkeypatch):
    """At a run's end every partition out of shards polls the claims: one listing a poll, no
    read of a claim or a heartbeat while nobody is gone (the end took seconds at 16 simulated
    partitions, a read per unfinished shard and per holder each poll)."""
    store = LocalStorage(tmp_path / "out", create=True)
    with ShardClaims(store, "run9", 1, beat_s=60, stale_s=3600) as holder:
        assert all(holder.claim(shard) for shard in shards(3))
        waiting = ShardClaims(store, "run9", 0, stale_s=3600)
        reads = []
        monkeypatch.setattr(store, "read", lambda key: reads.append(key) or b"")
        assert [waiting.retake() for _ in range(3)] == [[], [], []] and reads == []
        monkeypatch.undo()
    assert waiting.retake() == [0, 1, 2]  # it said it finished with its shards not done: retaken at once


def test_a_shard_done_between_the_listing_and_its_holders_finish_is_not_retaken(tmp_path, monkeypatch):
    """A waiting partition lists the claims, then reads each holder's heartbeat: a holder that
    marked its shard done and said it finished in between is not retaken from (which would
    caption the shard again)."""
    store = LocalStorage(tmp_path / "out", create=True)
    with ShardClaims(store, "run4", 1, beat_s=60, stale_s=3600) as holder:
        assert holder.claim(shards(1)[0])
        other = ShardClaims(store, "run4", 0, stale_s=3600)
        listed = other.unfinished()
        assert listed == {0: 0}
        holder.mark_done(0)
    assert other.unfinished() == {} and "p1" in other._finished  # done, and its holder said it finished
    monkeypatch.setattr(other, "unfinished", lambda: dict(listed))  # as listed before the mark landed
    assert other.retake() == [] and not store.exists("claims/run4/000000.r1")


# ---- the shard plan: one listing per run, read by every partition (tasks/shard_plan.py) ----------

class CountedSource:
    """A source of `count` objects whose listings are counted."""

    def __init__(self, count: int):
        self.count, self.listings = count, 0

    def iter_objects(self, glob=None, prefix=""):
        self.listings += 1
        for i in range(self.count):
            yield ObjectRef(f"img/{i:05d}.jpg", 100, "e")


@pytest.fixture
def planned_source(monkeypatch):
    """A source whose listing is counted, and list-source run on a thread (no flow here)."""
    import vlm_caption.tasks.sources.formats as formats
    import vlm_caption.tasks.sources.listing as listing
    from vlm_caption.tasks.sources.formats import SourceSpec

    class OnAThread:
        @staticmethod
        def submit(stream):
            threading.Thread(target=stream.produce, daemon=True).start()

    monkeypatch.setattr(listing, "list_source", OnAThread)

    def make(count: int):
        source = CountedSource(count)
        monkeypatch.setattr(formats, "source_storage", lambda uri, follow_links=False: source)
        return source, SourceSpec("s3://synthetic/")
    return make


def _every_third_done(items):
    return [int(item.id[4:9]) % 3 != 0 for item in items]  # items 0, 3, 6, ... were done before


def test_partitions_read_one_listing_through_the_plan_and_each_shard_is_taken_once(store, planned_source):
    """Three partitions start together: the source is listed once, by the one that won the plan;
    every partition reads the same shards from it, cut from the items with work left only; each
    shard is claimed by one partition; the items already done are counted once, by the lister."""
    from vlm_caption.tasks.shard_plan import SharedListing
    from vlm_caption.tasks.sources.listing import AlreadyDone

    source, spec = planned_source(1000)
    taken: list[tuple[int, int, tuple[str, ...]]] = []
    done_counted: dict[int, int] = {}
    listers = []

    def partition(index: int):
        with ShardClaims(store, "run4", index, beat_s=0.2) as claims:
            plan = SharedListing(store, "run4", claims, spec, 8, None, _every_third_done, poll_s=0.05).start()
            listers.append(plan.lists)
            done_counted[index] = 0
            for listed in claims.claimed(plan):
                if isinstance(listed, AlreadyDone):
                    done_counted[index] += listed.items
                    continue
                taken.append((index, listed.index, tuple(item.id for item in listed.items)))
                claims.mark_done(listed.index)
            while claims.retake() is not None:
                time.sleep(0.05)

    threads = [threading.Thread(target=partition, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert source.listings == 1 and sorted(listers) == [False, False, True]
    pending = [f"img/{i:05d}.jpg" for i in range(1000) if i % 3]
    assert sorted(shard for _, shard, _ in taken) == list(range(-(-len(pending) // 8)))  # each shard once
    assert sorted(key for *_, keys in taken for key in keys) == pending  # full shards of what is left
    assert sum(done_counted.values()) == 334 and sorted(done_counted.values())[:2] == [0, 0]


def test_a_partition_that_starts_late_reads_the_plan_and_lists_nothing(store, planned_source):
    from vlm_caption.tasks.shard_plan import SharedListing

    source, spec = planned_source(100)
    with ShardClaims(store, "run5", 0) as first:
        list(SharedListing(store, "run5", first, spec, 10, None, lambda items: [True] * len(items)).start())
    with ShardClaims(store, "run5", 1) as late:
        plan = SharedListing(store, "run5", late, spec, 10, None, lambda items: [True] * len(items)).start()
        assert [shard.index for shard in plan] == list(range(10)) and not plan.lists
    assert source.listings == 1


def test_a_lister_that_is_gone_is_replaced_after_the_shards_it_wrote(store, planned_source):
    """The partition listing the source died after its first chunk: another lists the rest,
    after the items that chunk covers, and every shard is in the plan once."""
    import json

    from vlm_caption.tasks.shard_plan import PlanWriter, SharedListing

    source, spec = planned_source(200)
    everything = lambda items: [True] * len(items)  # noqa: E731
    dead = PlanWriter(store, "run6", "p1", spec, 10, None, everything)
    dead.put = _stop_after_first_chunk(dead)
    store.create("claims/run6/plan/lister", json.dumps({"owner": "p1"}).encode())
    dead.produce()
    store.write("claims/run6/alive-p1.json", json.dumps({"beat": 1, "state": "finished", "partition": 1}).encode())
    with ShardClaims(store, "run6", 0) as survivor:
        plan = SharedListing(store, "run6", survivor, spec, 10, None, everything, poll_s=0.05).start()
        shards = list(plan)
        assert plan.lists  # it took the listing over
    assert [shard.index for shard in shards] == list(range(20))
    assert [item.id for shard in shards for item in shard.items] == [f"img/{i:05d}.jpg" for i in range(200)]
    assert store.exists("claims/run6/plan/lister.r1") and source.listings == 2


def _stop_after_first_chunk(writer):
    from vlm_caption.tasks.sources.listing import StreamClosed

    put = writer.put

    def put_until_a_chunk_is_written(thing):
        if writer.chunk >= 1:
            raise StreamClosed  # the process is gone
        put(thing)
        if thing is not None and len(writer._shards) == 3:
            writer._write_chunk()
    return put_until_a_chunk_is_written


def test_a_finished_runs_claims_are_removed(store, planned_source):
    from vlm_caption.tasks.claims import remove_claims
    from vlm_caption.tasks.shard_plan import SharedListing

    _, spec = planned_source(30)
    with ShardClaims(store, "run7", 0) as claims:
        for shard in claims.claimed(SharedListing(store, "run7", claims, spec, 10, None,
                                                  lambda items: [True] * len(items)).start()):
            claims.mark_done(shard.index)
    with ShardClaims(store, "run8", 0) as other:  # another run's claims stay
        other.claim(shards(1)[0])
    assert remove_claims(store, "run7") >= 3 + 3 + 2 + 2  # claims, done marks, heartbeat and its mark, plan
    assert list(store.iter_objects(prefix="claims/run7/")) == []
    assert [ref.key for ref in store.iter_objects(prefix="claims/run8/")] == [
        "claims/run8/000000", "claims/run8/alive-p0.json", "claims/run8/finished-p0"]
    if isinstance(store, LocalStorage):
        assert not (store.root / "claims" / "run7").exists()


def test_partitions_claim_each_chunk_of_the_plan_from_their_own_share_on(tmp_path, planned_source, monkeypatch):
    """Four partitions take turns at the same plan (48 shards, three chunks of 16) on a folder:
    each shard is won once; each partition's first shard is the first of its own quarter of the
    first chunk, not the plan's first free shard for all; and a claim is lost only where a
    partition has run through its share of a chunk into another's (once a chunk each), not at
    nearly every turn."""
    import vlm_caption.tasks.shard_plan as shard_plan

    monkeypatch.setattr(shard_plan, "CHUNK_S", 3600.0)  # chunks cut at CHUNK_SHARDS (16) only, however slow the listing
    store = LocalStorage(tmp_path / "out", create=True)
    _, spec = planned_source(48 * 8)
    everything = lambda items: [True] * len(items)  # noqa: E731
    partitions = [ShardClaims(store, "run9", i, partitions=4) for i in range(4)]
    plan = lambda claims: shard_plan.SharedListing(store, "run9", claims, spec, 8, None, everything)  # noqa: E731
    list(plan(partitions[0]).start())  # the plan listed whole before the claims begin
    lost, create = [], store.create
    store.create = lambda key, data: create(key, data) or lost.append(key)  # a claim lost: None
    turns = {claims.partition: claims.claimed(plan(claims).start()) for claims in partitions}
    won: dict[int, list[int]] = {index: [] for index in turns}
    while turns:
        for index, turn in list(turns.items()):
            if (shard := next(turn, None)) is None:
                del turns[index]
            else:
                won[index].append(shard.index)
    assert sorted(shard for shards in won.values() for shard in shards) == list(range(48))  # each once
    assert [won[i][0] for i in range(4)] == [0, 4, 8, 12], won
    shard_claims_lost = [key for key in lost if "/plan/" not in key]  # (not the plan's lister, taken)
    assert len(shard_claims_lost) <= 4 * 3, shard_claims_lost
