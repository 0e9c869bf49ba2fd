"""The done-index: a load lists the Parquet view once and reads the hash columns (`done_key`,
`listed_hash`, `content_hash`) of its files and of the parts of runs not folded into them yet (a
killed run's, a running one's: under `parquet/<fp>/`); a part's retryable failures are not done.
A file that cannot be read is skipped and named; one whose read fails for a moment is read again,
never skipped. A run's fold leaves every result in the view at each of its steps (a load between
them finds each result once or twice, never not at all). A view file written before the hash
columns existed gives the same rows. An earlier answer is read back from a view row. 100k earlier
results in a view file load fast in bounded memory (the production target is 1M in < 10 s and
< 500 MB: tests/done_index_scale.py)."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.done_index import DoneIndex, load_done_index, read_done_index
from vlm_caption.tasks.results.done_rows import ROW, load_rows
from vlm_caption.tasks.results.layout import PARQUET_VIEW_PREFIX, VIEW_HASHES, part_key, parts_prefix, run_parquet_key
from vlm_caption.tasks.results.parquet import view_row, write_rows
from vlm_caption.tasks.results.parquet_view import export_after_run, fold_run, parts_by_run
from vlm_caption.tasks.results.writers import write_shard
from vlm_caption.tasks.sources.items import ObjectRef, WorkItem
from vlm_caption.tasks.sources.storage import Storage, open_storage
from tests.recording_storage import RecordingStorage

FP = "f" * 16
RUN1, RUN2 = "aaaa0000-20260101T000000", "bbbb0000-20260102T000000"
SOURCE = "s3://media/photos/"


def _out(folder) -> Storage:
    """The output's storage, as a run's plan hands it to the writers and the done-index."""
    return open_storage(str(folder), create=True)


def _record(i: int, question: str = "q", error=None, fingerprint: str = FP) -> ResultRecord:
    return ResultRecord(key=f"img/{i:07d}.jpg", size=100 + i, etag=f"e{i}", sha256=f"{i:064x}", recipe="llava",
                        model="m", question=question, prompt=None, text=f"caption {i}", finish_reason="stop",
                        error=error, timings={}, fingerprint=fingerprint, run_id="r")


def _item(i: int, etag: str | None = None) -> WorkItem:
    key = f"img/{i:07d}.jpg"
    return WorkItem(key, (ObjectRef(key, 100 + i, etag or f"e{i}"),))


def _load(out: Storage) -> tuple[DoneIndex, RecordingStorage]:
    watched = RecordingStorage(out)
    return load_done_index.fn(watched, FP), watched


def _done(index: DoneIndex, *numbers: int) -> bool:
    return all(index.pending_by_listing(_item(i), ("q",)) == () for i in numbers)


def _parts_read(watched: RecordingStorage) -> list[str]:
    return sorted({key for key in watched.reads if key.startswith(parts_prefix(FP))})


def _fold(out: Storage, run: str, fingerprint: str = FP) -> dict:
    """What a run's end does with `run`'s parts."""
    return fold_run(out, fingerprint, run, parts_by_run(out, fingerprint)[run], read_done_index(out, fingerprint))


def test_the_parts_of_a_run_not_folded_yet_are_read(tmp_path):
    out = _out(tmp_path / "out")
    retryable = {"kind": "fetch", "message": "timeout", "retryable": True}
    write_shard(out, FP, RUN1, 0, [_record(0), _record(1), _record(2, error=retryable)], SOURCE)
    write_shard(out, FP, RUN1, 1, [_record(3), _record(3, question="other")], SOURCE)
    assert not [ref for ref in out.iter_objects(prefix=PARQUET_VIEW_PREFIX) if ref.key.count("/") == 1]

    loaded = load_rows(out, FP)
    assert sorted(s.key for s in loaded.sources) == [part_key(FP, RUN1, 0), part_key(FP, RUN1, 1)]
    done = DoneIndex(loaded.sources, out)
    assert len(done) == 4  # final records only
    assert done.pending_by_listing(_item(0), ("q", "new")) == ("new",)
    assert done.pending_by_listing(_item(2), ("q",)) == ("q",)  # a retryable failure is not done
    assert done.pending_by_listing(_item(0, etag="changed"), ("q",)) == ("q",)
    assert done.pending_by_content(_item(0).id, f"{0:064x}", ("q",)) == ()
    assert done.pending_by_listing(_item(3), ("q", "other")) == ()
    assert done.earlier_answer("q", sha256=f"{1:064x}").text == "caption 1"  # read back from a part

    # A file that cannot be read is skipped, named: its items are computed again.
    out.write(part_key(FP, RUN1, 2), b"\xff\xfe not parquet")
    loaded = load_rows(out, FP)
    assert loaded.unreadable == [part_key(FP, RUN1, 2)] and sum(len(s.rows) for s in loaded.sources) == 4


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_once_a_run_is_folded_a_load_lists_the_view_once_and_reads_its_file(tmp_path, where, request):
    if where == "s3":
        request.getfixturevalue("s3_client").create_bucket(Bucket="view")
        out = open_storage("s3://view/out/")
    else:
        out = _out(tmp_path / "out")
    for shard in range(3):
        write_shard(out, FP, RUN1, shard, [_record(2 * shard), _record(2 * shard + 1)], SOURCE)
    export_after_run.fn(out, out.uri, FP, RUN1)
    assert out.exists(run_parquet_key(RUN1)) and parts_by_run(out, FP) == {}

    done, watched = _load(out)  # a night with nothing new: one listing, the view file's columns
    assert len(done) == 6 and _done(done, 0, 5)
    assert watched.listed == [PARQUET_VIEW_PREFIX]
    assert set(watched.reads) <= {run_parquet_key(RUN1)}  # (a folder's file is opened, not read)

    # A run that wrote since and is not folded yet: its parts are read too.
    write_shard(out, FP, RUN2, 0, [_record(100)], SOURCE)
    done, watched = _load(out)
    assert len(done) == 7 and _done(done, 0, 5, 100)
    assert watched.listed == [PARQUET_VIEW_PREFIX]


class LoadsAtEachStep:
    """The output, where a load runs after each write and each delete: what a reader of the view
    (or the next run's start) finds at every step of a fold."""

    def __init__(self, inner: Storage):
        self.inner, self.found = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _look(self):
        self.found.append(np.unique(DoneIndex(load_rows(self.inner, FP).sources)._table["key"]).size)

    def write(self, key, data):
        self.inner.write(key, data)
        self._look()

    def delete(self, key):
        self.inner.delete(key)
        self._look()


def test_a_fold_leaves_every_result_in_the_view_at_each_step_and_folded_again_gives_the_same(tmp_path):
    """Killed between any two steps of its fold (its file written, an older file rewritten, a
    part deleted), a run leaves each result in the view, at worst twice; the next run folds what
    is left (with the run's file where it was written), and the view holds each result once, the
    latest."""
    out = _out(tmp_path / "out")
    write_shard(out, FP, RUN1, 0, [_record(0), _record(1)], SOURCE)
    _fold(out, RUN1)
    again = ResultRecord(**{**_record(1).model_dump(), "etag": "re-uploaded", "text": "again"})
    for shard, records in enumerate([[again], [_record(2)], [_record(3)]]):
        write_shard(out, FP, RUN2, shard, records, SOURCE)
    watched = LoadsAtEachStep(out)
    fold_run(watched, FP, RUN2, parts_by_run(out, FP)[RUN2], read_done_index(out, FP))
    assert len(watched.found) == 5 and set(watched.found) == {4}  # its file, RUN1's rewritten, 3 parts gone

    # The same parts left again (killed before their delete): the next run folds them once more.
    for shard, records in enumerate([[again], [_record(2)], [_record(3)]]):
        write_shard(out, FP, RUN2, shard, records, SOURCE)
    report = export_after_run.fn(out, out.uri, FP, "cccc0000-20260103T000000")
    assert report["complete"] and report["repaired"][RUN2]["rows"] == 3 and parts_by_run(out, FP) == {}
    rows = [row for s in load_rows(out, FP).sources for row in s.rows["key"].tolist()]
    assert len(rows) == len(set(rows)) == 4
    assert read_done_index(out, FP).earlier_answer("q", sha256=f"{1:064x}").text == "again"

    # Killed while deleting its parts (one left): folded again, its file still holds all three.
    write_shard(out, FP, RUN2, 2, [_record(3)], SOURCE)
    report = export_after_run.fn(out, out.uri, FP, "dddd0000-20260104T000000")
    assert report["repaired"][RUN2]["rows"] == 3 and parts_by_run(out, FP) == {}
    rows = [row for s in load_rows(out, FP).sources for row in s.rows["key"].tolist()]
    assert len(rows) == len(set(rows)) == 4


def test_a_view_file_without_the_hash_columns_gives_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = _out(tmp_path / "out")
    group = ResultRecord(**{**_record(7).model_dump(), "sha256": None, "members": [
        {"key": "g/a.jpg", "size": 3, "etag": "ea"}, {"key": "g/b.jpg", "size": 4, "etag": "eb"}]})
    records = [_record(0), _record(1, question=None), _record(2, error={"kind": "decode", "message": "bad"}), group]
    write_shard(out, FP, RUN1, 0, records, SOURCE)
    _fold(out, RUN1)
    hashed = load_rows(out, FP).sources

    table = pq.read_table(tmp_path / "out" / run_parquet_key(RUN1))
    older = table.drop_columns(list(VIEW_HASHES) + ["error_retryable"])
    assert not set(VIEW_HASHES) & set(older.column_names)
    out.write(run_parquet_key(RUN1), _parquet_bytes(pa, pq, older))
    computed = load_rows(out, FP).sources
    assert [s.key for s in computed] == [s.key for s in hashed] == [run_parquet_key(RUN1)]
    assert len(computed[0].rows) == 4 and computed[0].rows.tobytes() == hashed[0].rows.tobytes()


def _parquet_bytes(pa, pq, table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def test_a_file_whose_read_fails_for_a_moment_is_read_again_never_skipped(tmp_path, monkeypatch):
    """A read of a part (or a view file) that fails transiently (a body cut short, a timeout) is
    tried again, and one that keeps failing fails the load (retried as a task) instead of leaving
    the file's results out, which a run would compute and write twice."""
    import vlm_caption.tasks.results.done_rows as done_rows
    import vlm_caption.tasks.sources.s3_client as transient
    from vlm_caption.tasks.sources.storage import ShortBodyError

    monkeypatch.setattr(transient, "PAUSE_S", 0.01)
    out = _out(tmp_path / "out")
    write_shard(out, FP, RUN1, 0, [_record(0), _record(1)], SOURCE)
    opened, failures = done_rows.open_seekable, [0]

    def flaky(storage, key, size):
        if failures[0] > 0:
            failures[0] -= 1
            raise ShortBodyError(f"{key}: 10 of 900 bytes")
        return opened(storage, key, size)

    monkeypatch.setattr(done_rows, "open_seekable", flaky)
    failures[0] = 2  # fails twice, then answers
    assert _done(load_done_index.fn(out, FP), 0, 1) and failures[0] == 0
    failures[0] = 99  # keeps failing: the load fails rather than forget the part
    with pytest.raises(ShortBodyError):
        load_done_index.fn(out, FP)


def test_an_earlier_answer_is_read_back_from_a_view_row(tmp_path):
    """The row a copy's answer comes from is found among a file's rows of other fingerprints, in
    a row group past the first, and in a file of this fingerprint's rows only."""
    out, other = _out(tmp_path / "out"), "e" * 16
    mine = [_record(i) for i in range(6)]
    mixed = [r for i, record in enumerate(mine[:5]) for r in (_record(50 + i, fingerprint=other), record)]
    write_rows(out, run_parquet_key(RUN1), [_view_rows(mixed)], row_group_rows=3)
    write_shard(out, FP, RUN2, 0, mine[5:], SOURCE)
    _fold(out, RUN2)
    done, watched = _load(out)
    assert len(done) == 6
    for original in mine:
        found = done.earlier_answer("q", sha256=original.sha256)
        assert (found.key, found.text, found.finish_reason, found.question) == (
            original.key, original.text, original.finish_reason, original.question)
    assert done.earlier_answer("other question", sha256=mine[0].sha256) is None
    assert not _parts_read(watched)


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_a_listing_under_a_prefix_that_ends_inside_a_name(tmp_path, where, request):
    """What a fold lists a run's parts with (`part_prefix`): its parts and its partitions', not
    another run's whose id begins with it; the same on a folder and on S3."""
    if where == "s3":
        request.getfixturevalue("s3_client").create_bucket(Bucket="prefix")
        store = open_storage("s3://prefix/out/")
    else:
        store = _out(tmp_path / "out")
    for key in ["r/part-x-00000.parquet", "r/part-x-p0-00000.parquet", "r/part-xy-00000.parquet"]:
        store.write(key, b"1")
    keys = lambda prefix: [ref.key for ref in store.iter_objects(prefix=prefix)]  # noqa: E731
    assert keys("r/part-x-") == ["r/part-x-00000.parquet", "r/part-x-p0-00000.parquet"]
    assert keys("r/nothing-") == []


def test_an_empty_index_has_everything_pending():
    done = DoneIndex()
    assert len(done) == 0 and done.pending_by_listing(_item(1), ("q",)) == ("q",)
    assert done.pending_by_content("x", "abc", ("q",)) == ("q",)


def _view_rows(records: list[ResultRecord]) -> list[dict]:
    """The records' view rows, as `fold_run` writes them."""
    return [view_row(record, None) for record in records]


def write_view_file(out: Storage, run_id: str, total: int) -> None:
    """A run's view file of `_record(0)` ... `_record(total - 1)`: `_view_rows`'s rows, made
    column by column (a record and a dict per row would take most of the test's time)."""
    import pyarrow as pa

    from vlm_caption.tasks.results.done_rows import content_hash, result_key, signature_hash
    from vlm_caption.tasks.results.parquet import results_schema

    schema, numbers = results_schema(), range(total)
    keys, etags = [f"img/{i:07d}.jpg" for i in numbers], [f"e{i}" for i in numbers]
    shas = [f"{i:064x}" for i in numbers]
    varying = {"key": keys, "etag": etags, "sha256": shas, "size": [100 + i for i in numbers],
               "caption": [f"caption {i}" for i in numbers], "done_key": [result_key(k, "q") for k in keys],
               "listed_hash": [signature_hash(((e, 100 + i),)) for i, e in enumerate(etags)],
               "content_hash": [content_hash(sha) for sha in shas]}
    same = _view_rows([_record(0)])[0]
    table = pa.table({field.name: pa.array(varying.get(field.name) or [same[field.name]] * total, field.type)
                      for field in schema}, schema=schema)
    for i in (0, total - 1):  # the rows `view_row` makes
        assert table.slice(i, 1).to_pylist() == pa.Table.from_pylist(_view_rows([_record(i)]), schema).to_pylist()
    write_rows(out, run_parquet_key(run_id), [table])


def test_100k_earlier_results_load_fast_in_bounded_memory(tmp_path):
    out, total = _out(tmp_path / "out"), 100_000
    write_view_file(out, RUN1, total)
    tracemalloc.start()
    began = time.perf_counter()
    done = load_done_index.fn(out, FP)
    seconds = time.perf_counter() - began
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"DONE-INDEX 100k results in a view file: {seconds:.2f} s, peak {peak / 2**20:.1f} MiB, "
          f"index {done.nbytes / 2**20:.1f} MiB")
    assert len(done) == total and done.nbytes == total * (ROW.itemsize + 4)  # + which source and row
    assert seconds < 5 and peak < 32 * 2**20  # a parsed record per result would take ~10x this
    assert _done(done, 0, total - 1) and not _done(done, total)
