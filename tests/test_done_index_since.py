"""A done-index load lists only what is new: the compacted index, the `writing/` stamps since it,
and the parts of the writers stamped there (tasks/results/writing_log.py), never the history.
The cases a listing from the last part name the index holds would get wrong: a partition still
writing while another compacts (its later parts' names sort before the index's last), a run that
wrote before the index and writes again, a part its writer rewrote. The clock is moved (days
between runs); a night is a load."""

from __future__ import annotations

import json
import time as real_time

import pytest

from vlm_caption.tasks.results import done_index, done_rows, layout, writing_log
from vlm_caption.tasks.results.done_index import COMPACT_AFTER, load_done_index
from vlm_caption.tasks.results.done_rows import COMPACT_HEADER
from vlm_caption.tasks.results.layout import (compacted_index_prefix, part_key, part_prefix, partition_parts_id,
                                  results_prefix, writing_prefix)
from vlm_caption.tasks.results.writers import write_shard
from vlm_caption.tasks.sources.storage import open_storage
from tests.test_done_index import FP, _item, _record
from tests.recording_storage import RecordingStorage

DAY = 86400.0
RUN = "cafe0000-20260101T000000"


class Clock:
    """time, moved by `offset` seconds (wall and monotonic alike)."""

    def __init__(self):
        self.offset = 0.0

    def time(self) -> float:
        return real_time.time() + self.offset

    def monotonic(self) -> float:
        return real_time.monotonic() + self.offset

    def __getattr__(self, name):
        return getattr(real_time, name)


@pytest.fixture
def clock(monkeypatch):
    moved = Clock()
    for module in (done_rows, writing_log, done_index, layout):
        monkeypatch.setattr(module, "time", moved)
    return moved


def write_parts(out, parts_id: str, shards, first: int = 0) -> None:
    """One result a part, records `first`, `first + 1`... (as a run's writer writes them, stamps included)."""
    for n, shard in enumerate(shards):
        write_shard(out, FP, parts_id, shard, [_record(first + n)])


def load(out):
    watched = RecordingStorage(out)
    return load_done_index.fn(watched, FP), watched


def indexes(out) -> list[str]:
    return [ref.key for ref in out.iter_objects(prefix=compacted_index_prefix(FP))]


def done(index, *numbers: int) -> bool:
    return all(index.pending_by_listing(_item(i), ("q",)) == () for i in numbers)


def test_a_night_with_nothing_new_lists_no_part_of_the_history(tmp_path, prefect_api, clock):
    out = open_storage(str(tmp_path / "out"), create=True)
    history = COMPACT_AFTER + 6
    clock.offset = -2 * DAY
    write_parts(out, "aaaa-old", range(history))
    clock.offset = -DAY
    index, watched = load(out)  # no index yet: everything listed, every sidecar read, then compacted
    assert len(index) == history and results_prefix(FP) in watched.listed and len(indexes(out)) == 1

    clock.offset = 0
    index, watched = load(out)
    assert len(index) == history and done(index, 0, history - 1)
    assert watched.listed == [compacted_index_prefix(FP), writing_prefix(FP)]  # no part listed
    assert watched.reads == indexes(out)

    # New results: their writer's parts are listed and read, nothing else.
    write_parts(out, "bbbb-new", [0, 1], first=1000)
    index, watched = load(out)
    assert watched.listed == [compacted_index_prefix(FP), writing_prefix(FP), part_prefix(FP, "bbbb-new")]
    assert sorted(watched.reads) == sorted(indexes(out) + [part_key(FP, "bbbb-new", s).replace(".jsonl", ".idx")
                                                           for s in (0, 1)])
    assert len(index) == history + 2 and done(index, 0, 1000, 1001)


def test_a_partition_still_writing_while_another_compacts_loses_no_part(tmp_path, prefect_api, clock):
    """Partition 1's load compacts while partition 0 is writing. Partition 0's next part is
    named before every part the index holds, and lands within its last stamp's minutes (no
    stamp of its own): the next night finds it all the same."""
    out = open_storage(str(tmp_path / "out"), create=True)
    p0, p1 = partition_parts_id(RUN, 0), partition_parts_id(RUN, 1)
    clock.offset = -DAY
    write_parts(out, p0, [0])
    write_parts(out, p1, range(COMPACT_AFTER + 6), first=100)
    load(out)  # partition 1's load at its start: compacts what is there
    (compacted,) = indexes(out)
    stamps = {ref.key for ref in out.iter_objects(prefix=writing_prefix(FP))}
    write_parts(out, p0, [1], first=500)
    assert {ref.key for ref in out.iter_objects(prefix=writing_prefix(FP))} == stamps  # no new stamp
    data = out.read(compacted)
    _, length = COMPACT_HEADER.unpack_from(data)
    held = [key for key, _, _ in json.loads(data[COMPACT_HEADER.size:COMPACT_HEADER.size + length])]
    assert part_key(FP, p0, 1) < max(held) and part_key(FP, p0, 1) not in held  # a name-ordered listing misses it

    clock.offset = 0
    index, watched = load(out)
    assert done(index, 0, 100, 500) and len(index) == COMPACT_AFTER + 8
    assert part_key(FP, p0, 1).replace(".jsonl", ".idx") in watched.reads


def test_a_run_stamped_before_the_index_that_writes_again_is_found(tmp_path, prefect_api, clock):
    """A run that wrote a part days ago and was thought dead writes again after a compaction
    whose index's stamps begin after its last: it stamps again first, and is listed."""
    out = open_storage(str(tmp_path / "out"), create=True)
    clock.offset = -3 * DAY
    write_parts(out, "dead0000-late", [0], first=900)
    clock.offset = -2 * DAY
    write_parts(out, "eeee-other", range(COMPACT_AFTER + 6))
    clock.offset = -DAY
    load(out)
    clock.offset = -DAY + 600
    write_parts(out, "dead0000-late", [1], first=901)
    clock.offset = 0
    index, watched = load(out)
    assert done(index, 900, 901, 0)
    assert part_prefix(FP, "dead0000-late") in watched.listed and part_prefix(FP, "eeee-other") not in watched.listed


def test_a_part_its_writer_rewrote_after_the_index_is_read_again(tmp_path, prefect_api, clock):
    """A shard's write tried again after a compaction held its first body (other records)."""
    out = open_storage(str(tmp_path / "out"), create=True)
    clock.offset = -DAY
    write_parts(out, "ffff-retry", range(COMPACT_AFTER + 6))
    load(out)
    clock.offset = -DAY + 7200
    write_shard(out, FP, "ffff-retry", 0, [_record(0), _record(7777)])
    clock.offset = 0
    index, _ = load(out)
    assert done(index, 0, 7777) and len(index) == COMPACT_AFTER + 7


def test_a_part_deleted_by_hand_long_after_counts_until_the_indexes_are_deleted(tmp_path, prefect_api, clock):
    """The limit of listing only what is new, as docs/operations.md says: a part deleted by hand
    once no stamp since the index names its writer still counts; deleting the compacted indexes
    makes the next load list everything, and then it does not."""
    out = open_storage(str(tmp_path / "out"), create=True)
    clock.offset = -2 * DAY
    write_parts(out, "2222-old", range(COMPACT_AFTER + 6))
    clock.offset = -DAY
    load(out)
    out.delete(part_key(FP, "2222-old", 3))
    clock.offset = 0
    index, _ = load(out)
    assert done(index, 3)
    for key in indexes(out):
        out.delete(key)
    index, _ = load(out)
    assert not done(index, 3) and done(index, 2, 4)


def test_a_stamp_is_written_every_few_minutes_while_a_writer_writes(tmp_path, clock):
    out = open_storage(str(tmp_path / "out"), create=True)
    stamps = lambda: [ref.key for ref in out.iter_objects(prefix=writing_prefix(FP))]  # noqa: E731
    write_parts(out, "3333-w", range(5))
    assert len(stamps()) == 1
    clock.offset += writing_log.REFRESH_S + 1
    write_parts(out, "3333-w", [5])
    assert len(stamps()) == 2 and all(key.endswith("-3333-w") for key in stamps())


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_a_listing_from_a_key_and_under_a_prefix_inside_a_name(tmp_path, where, request):
    """The storage call the load lists with: `start_after` skips the keys up to it (S3's
    StartAfter, never sent), `prefix` may end inside a name; the same on a folder and on S3."""
    if where == "s3":
        request.getfixturevalue("s3_client").create_bucket(Bucket="since")
        store = open_storage("s3://since/out/")
    else:
        store = open_storage(str(tmp_path / "out"), create=True)
    for key in ["r/w/20260101T000000-a", "r/w/20260102T000000-b", "r/w/20260103T000000-c", "r/part-x-00000.jsonl",
                "r/part-x-00000.idx", "r/part-xy-00000.jsonl", "r/index-1.vidx"]:
        store.write(key, b"1")
    keys = lambda **kw: [ref.key for ref in store.iter_objects(**kw)]  # noqa: E731
    assert keys(prefix="r/w/", start_after="r/w/20260101T235959") == ["r/w/20260102T000000-b", "r/w/20260103T000000-c"]
    assert keys(prefix="r/w/", start_after="r/w/20260103T000000-c") == []
    assert keys(prefix="r/part-x-") == ["r/part-x-00000.idx", "r/part-x-00000.jsonl"]
    assert keys(prefix="r/index-") == ["r/index-1.vidx"] and keys(prefix="r/nothing-") == []


def test_a_night_on_s3_reads_the_index_and_lists_no_part(s3_client, prefect_api, clock):
    s3_client.create_bucket(Bucket="nights")
    out = open_storage("s3://nights/out/")
    clock.offset = -2 * DAY
    write_parts(out, "aaaa-old", range(COMPACT_AFTER + 2))
    clock.offset = -DAY
    load(out)
    clock.offset = 0
    index, watched = load(out)
    assert len(index) == COMPACT_AFTER + 2 and watched.listed == [compacted_index_prefix(FP), writing_prefix(FP)]
    assert watched.reads == indexes(out)


def test_a_stamp_whose_own_write_took_too_long_is_written_again(tmp_path, clock, monkeypatch):
    """(W) needs a stamp that landed within WRITE_S of its time: a slow PUT's is taken again."""
    out = open_storage(str(tmp_path / "out"), create=True)
    write, written = out.write, []

    def slow(key: str, data: bytes) -> None:
        write(key, data)
        written.append(key)
        if len(written) == 1:
            clock.offset += writing_log.WRITE_S + 1

    monkeypatch.setattr(out, "write", slow)
    writing_log.after_part(out, FP, "4444-slow")
    assert len(written) == 2 and written[0] < written[1]
    assert sorted(ref.key for ref in out.iter_objects(prefix=writing_prefix(FP))) == written


def stamps(out) -> list[str]:
    return [ref.key for ref in out.iter_objects(prefix=writing_prefix(FP))]


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_stamps_no_load_can_need_are_removed_by_a_compaction(tmp_path, prefect_api, clock, where, request):
    """Each compacted index carries when the ones before it were written; once one of those is a
    week old, the stamps a week and two hours older than it go (writing_log.py, Removal), and the
    history stays done without a listing of its parts."""
    if where == "s3":
        request.getfixturevalue("s3_client").create_bucket(Bucket="month")
        out = open_storage("s3://month/out/")
    else:
        out = open_storage(str(tmp_path / "out"), create=True)
    batch = COMPACT_AFTER + 2
    clock.offset = -30 * DAY
    write_parts(out, "aaaa-old", range(batch))
    old_stamps = stamps(out)
    clock.offset = -29 * DAY
    load(out)  # the first index: everything listed
    clock.offset = -20.5 * DAY
    write_parts(out, "bbbb-mid", range(batch), first=1000)
    kept = set(stamps(out)) - set(old_stamps)
    clock.offset = -20 * DAY
    load(out)  # its lineage: the first index's stamp (29 days old), not a week old when it loads
    assert stamps(out) == old_stamps + sorted(kept)
    clock.offset = -DAY
    write_parts(out, "cccc-new", range(batch), first=2000)
    clock.offset = 0
    index, _ = load(out)  # the index of 20 days ago is a week old: stamps up to 27 days ago go
    assert set(stamps(out)) >= kept and not set(stamps(out)) & set(old_stamps)
    assert done(index, 0, batch - 1, 1000, 2000)
    index, watched = load(out)  # the next night, nothing new
    assert done(index, 0, 1000, 2000) and len(index) == 3 * batch
    assert watched.listed == [compacted_index_prefix(FP), writing_prefix(FP)]


def test_a_stamp_that_cannot_be_removed_is_counted_and_left(tmp_path, monkeypatch):
    out = open_storage(str(tmp_path / "out"), create=True)
    for written in ("20260101T000000", "20260102T000000", "20260103T000000", "20260201T000000"):
        out.write(writing_prefix(FP) + f"{written}-w", b"")
    refused = writing_prefix(FP) + "20260102T000000-w"

    def delete(key: str) -> None:
        if key == refused:
            raise PermissionError("AccessDenied")
        out.__class__.delete(out, key)

    monkeypatch.setattr(out, "delete", delete)
    monkeypatch.setattr(writing_log, "REMOVE_MAX", 2)  # the rest wait for the next compaction
    assert writing_log.remove_stamps(out, FP, "20260110T000000") == (1, 1)
    assert [key.rsplit("/", 1)[1] for key in stamps(out)] == [
        "20260102T000000-w", "20260103T000000-w", "20260201T000000-w"]
    assert writing_log.kept_lineage(["20260101T000000"], real_time.time())[1] == "20251224T220000"
    assert writing_log.kept_lineage([writing_log.stamp(real_time.time() - DAY)], real_time.time())[1] is None
    assert writing_log.kept_lineage(["20250101T000000", "20250301T000000", "29990101T000000"],
                                    real_time.time())[0] == ["20250301T000000", "29990101T000000"]


def test_a_stamp_listing_that_fails_leaves_the_compaction_done(tmp_path, monkeypatch):
    """Removing stamps is best effort, as the compaction is: a listing of `writing/` that fails is
    logged, and the load goes on with its new index written."""
    from types import SimpleNamespace

    from vlm_caption.tasks.results.done_rows import PartRows

    out = open_storage(str(tmp_path / "out"), create=True)

    def refused(*args):
        raise ConnectionError("the store did not answer")

    monkeypatch.setattr(done_index, "remove_stamps", refused)
    said = []
    log = SimpleNamespace(warning=lambda event, **fields: said.append(event), info=lambda event, **fields: None)
    loaded = PartRows({}, {}, set(), [], 0, after="20260101T000000", lineage=["20250101T000000"])
    done_index._compact(out, FP, {}, loaded, log)
    assert len(indexes(out)) == 1 and said == ["could not list the writing stamps to remove"]
