"""The partitions of a fan-out share the shards through claims in the output store
(tasks/claims.py): each shard is won by exactly one partition, a slow or late partition takes
fewer, and the shards of a partition that is gone are retaken, on a folder and on S3 (moto's
server, conditional PUTs over real HTTP)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from tasks.claims import ShardClaims
from tasks.sources.items import ObjectRef, Shard, WorkItem
from tasks.sources.storage import LocalStorage, open_storage


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
    from tasks.settings import get_settings

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
    dead._beat("running")  # it beat once, claimed two shards, finished one and died (no `finished`)
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
    from tasks.sources.storage import LocalStorage as Local
    import tempfile

    store = Local(tempfile.mkdtemp(), create=True)
    listing = shards(2)
    with ShardClaims(store, "run3", 1, beat_s=60, stale_s=3600) as quitter:
        assert quitter.claim(listing[0])
    # it ended (an engine that failed to start) with its shard unfinished: retaken at once
    other = ShardClaims(store, "run3", 0, stale_s=3600)
    assert other.retake() == [0]
