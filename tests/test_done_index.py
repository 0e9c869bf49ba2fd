"""The compact done-index: each results part's sidecar of 24-byte rows is what a rerun reads;
a part without one, or whose body changed since, is parsed instead; 100k earlier results load
fast in bounded memory (the production target is 1M in < 10 s and < 500 MB)."""

from __future__ import annotations

import time
import tracemalloc

from vlm_caption.tasks.results.done_index import DoneIndex, load_done_index
from vlm_caption.tasks.results.done_rows import ROW, sidecar_key
from vlm_caption.tasks.results.layout import part_key
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.writers import write_shard
from vlm_caption.tasks.sources.items import ObjectRef, WorkItem
from vlm_caption.tasks.sources.storage import Storage, open_storage

FP = "f" * 16


def _out(folder) -> Storage:
    """The output's storage, as a run's plan hands it to the writers and the done-index."""
    return open_storage(str(folder), create=True)


def _record(i: int, question: str = "q", error=None) -> ResultRecord:
    return ResultRecord(key=f"img/{i:07d}.jpg", size=100 + i, etag=f"e{i}", sha256=f"{i:064x}", recipe="llava",
                        model="m", question=question, prompt=None, text="a caption", finish_reason="stop",
                        error=error, timings={}, fingerprint=FP, run_id="r")


def _item(i: int, etag: str | None = None) -> WorkItem:
    key = f"img/{i:07d}.jpg"
    return WorkItem(key, (ObjectRef(key, 100 + i, etag or f"e{i}"),))


def test_sidecars_are_read_and_a_changed_part_is_parsed(tmp_path, prefect_api):
    out = tmp_path / "out"
    retryable = {"kind": "fetch", "message": "timeout", "retryable": True}
    write_shard(_out(out), FP, "run1", 0, [_record(0), _record(1), _record(2, error=retryable)])
    write_shard(_out(out), FP, "run1", 1, [_record(3), _record(3, question="other")])
    part0 = out / part_key(FP, "run1", 0)
    assert (out / sidecar_key(part_key(FP, "run1", 0))).stat().st_size == 16 + 2 * ROW.itemsize  # final rows only

    done = load_done_index.fn(_out(out), FP)
    assert len(done) == 4
    assert done.pending_by_listing(_item(0), ("q", "new")) == ("new",)
    assert done.pending_by_listing(_item(2), ("q",)) == ("q",)  # a retryable failure is not done
    assert done.pending_by_listing(_item(0, etag="changed"), ("q",)) == ("q",)
    assert done.pending_by_content(_item(0).id, f"{0:064x}", ("q",)) == ()
    assert done.pending_by_listing(_item(3), ("q", "other")) == ()

    # A part cut short (its sidecar no longer matches its size) is parsed: what it lost is redone.
    part0.write_bytes(part0.read_bytes().split(b"\n", 1)[0] + b"\n")
    done = load_done_index.fn(_out(out), FP)
    assert done.pending_by_listing(_item(0), ("q",)) == () and done.pending_by_listing(_item(1), ("q",)) == ("q",)
    # A part written before sidecars existed is parsed too.
    (out / sidecar_key(part_key(FP, "run1", 1))).unlink()
    assert len(load_done_index.fn(_out(out), FP)) == 3


def test_100k_earlier_results_load_fast_in_bounded_memory(tmp_path, prefect_api):
    out, per_part, total = tmp_path / "out", 64, 100_000
    for shard, start in enumerate(range(0, total, per_part)):
        write_shard(_out(out), FP, "big", shard, [_record(i) for i in range(start, min(start + per_part, total))])
    tracemalloc.start()
    began = time.perf_counter()
    done = load_done_index.fn(_out(out), FP)
    seconds = time.perf_counter() - began
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"DONE-INDEX 100k records, {total // per_part + 1} parts: {seconds:.2f} s, peak {peak / 2**20:.1f} MiB, "
          f"index {done.nbytes / 2**20:.1f} MiB")
    assert len(done) == total and done.nbytes == total * (ROW.itemsize + 4)  # + which part and line
    assert peak < 64 * 2**20  # a dict of records would take ~20x this
    assert done.pending_by_listing(_item(99_999), ("q",)) == () and done.pending_by_listing(_item(total), ("q",))


def test_an_empty_index_has_everything_pending():
    done = DoneIndex()
    assert len(done) == 0 and done.pending_by_listing(_item(1), ("q",)) == ("q",)
    assert done.pending_by_content("x", "abc", ("q",)) == ("q",)


class CountingStorage:
    """The output storage, counting the objects read (on an object store, one GET each)."""

    def __init__(self, inner):
        self.inner, self.reads = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read(self, key: str) -> bytes:
        self.reads.append(key)
        return self.inner.read(key)


def _load_counting(out) -> tuple[DoneIndex, list[str]]:
    storage = CountingStorage(_out(out))
    return load_done_index.fn(storage, FP), storage.reads


def test_a_long_history_is_compacted_into_one_object_and_stays_exact(tmp_path, prefect_api):
    from vlm_caption.tasks.results.done_index import COMPACT_AFTER

    out = tmp_path / "out"
    for shard in range(COMPACT_AFTER + 6):
        write_shard(_out(out), FP, "old", shard, [_record(2 * shard), _record(2 * shard + 1)])
    total = 2 * (COMPACT_AFTER + 6)
    broken = out / part_key(FP, "broken", 0)
    broken.write_bytes(b"\xff\xfe not text")  # unreadable, and no sidecar
    done, reads = _load_counting(out)  # every sidecar read, then compacted
    assert len(done) == total and len(reads) == COMPACT_AFTER + 6 + 1
    compacted = sorted((out / "results" / FP).glob("*.vidx"))
    assert len(compacted) == 1

    # One object for the whole history; the part that could not be read is tried again.
    done, reads = _load_counting(out)
    assert len(done) == total and reads == [f"results/{FP}/{compacted[0].name}", part_key(FP, "broken", 0)]
    broken.unlink()

    # Parts written since are read beside it; a part cut short is parsed, and one deleted no
    # longer counts, though the compacted index still lists their rows.
    write_shard(_out(out), FP, "new", 0, [_record(total)])
    part0 = out / part_key(FP, "old", 0)
    part0.write_bytes(part0.read_bytes().split(b"\n", 1)[0] + b"\n")  # keeps record 0, loses 1
    (out / part_key(FP, "old", 1)).unlink()  # records 2 and 3
    done, reads = _load_counting(out)
    assert len(reads) == 4  # the compacted index, the new part's sidecar, part 0's (stale) and part 0
    assert len(done) == total + 1 - 3
    assert [done.pending_by_listing(_item(i), ("q",)) for i in (0, 1, 2, 4, total)] == [(), ("q",), ("q",), (), ()]

    # A damaged compacted index is passed over (the sidecars answer), then replaced.
    compacted[0].write_bytes(b"garbage")
    done, reads = _load_counting(out)
    assert len(done) == total + 1 - 3 and len(reads) > COMPACT_AFTER
    assert [p.name for p in (out / "results" / FP).glob("*.vidx")] != [compacted[0].name]
    assert len(list((out / "results" / FP).glob("*.vidx"))) == 1
    done, reads = _load_counting(out)
    assert len(done) == total + 1 - 3 and len(reads) == 1


def test_a_part_whose_read_fails_for_a_moment_is_read_again_never_skipped(tmp_path, prefect_api, monkeypatch):
    """A part without a usable sidecar is parsed; a read of it that fails transiently (a body cut
    short, a timeout) is tried again, and one that keeps failing fails the load (retried as a
    task) instead of leaving the part's results out, which a run would compute and write twice."""
    import pytest

    import vlm_caption.tasks.sources.transient as transient
    from vlm_caption.tasks.sources.storage import ShortBodyError

    monkeypatch.setattr(transient, "PAUSE_S", 0.01)
    out = _out(tmp_path / "out")
    write_shard(out, FP, "run1", 0, [_record(0), _record(1)])
    out.delete(sidecar_key(part_key(FP, "run1", 0)))  # so the part itself is read
    read, failures = out.read, []

    def flaky(key: str) -> bytes:
        if key.endswith(".jsonl") and failures and failures[0] > 0:
            failures[0] -= 1
            raise ShortBodyError(f"{key}: 10 of 900 bytes")
        return read(key)

    monkeypatch.setattr(out, "read", flaky)
    failures[:] = [2]  # fails twice, then answers
    done = load_done_index.fn(out, FP)
    assert not done.pending_by_listing(_item(0), ("q",)) and not done.pending_by_listing(_item(1), ("q",))
    failures[:] = [99]  # keeps failing: the load fails rather than forget the part
    with pytest.raises(ShortBodyError):
        load_done_index.fn(out, FP)
