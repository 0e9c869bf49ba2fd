"""The done-index: a load reads the Parquet view's hash columns (`done_key`, `listed_hash`,
`content_hash`) and parses only the parts of the runs the view still owes a file
(`results/<fp>/view-owed/<run>`), or every part where the view holds nothing of the fingerprint.
A part that cannot be read is skipped and named; one whose read fails for a moment is read
again, never skipped. The owed marks are listed before the view files (a run writes its file,
then removes its mark). A view file written before the hash columns existed gives the same rows.
An earlier answer is read back from a view row. 100k earlier results in a view file load fast in
bounded memory (the production target is 1M in < 10 s and < 500 MB: tests/done_index_scale.py)."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.done_index import DoneIndex, load_done_index
from vlm_caption.tasks.results.done_rows import ROW, load_rows
from vlm_caption.tasks.results.layout import (PARQUET_VIEW_PREFIX, VIEW_HASHES, part_key, part_prefix,
                                              results_prefix, run_parquet_key, view_owed_key, view_owed_prefix)
from vlm_caption.tasks.results.parquet import view_row, write_rows
from vlm_caption.tasks.results.parquet_view import add_run, export_after_run
from vlm_caption.tasks.results.writers import write_shard
from vlm_caption.tasks.sources.items import ObjectRef, WorkItem
from vlm_caption.tasks.sources.storage import Storage, open_storage
from tests.recording_storage import RecordingStorage

FP = "f" * 16
RUN1, RUN2 = "aaaa0000-20260101T000000", "bbbb0000-20260102T000000"


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
    return sorted({key for key in watched.reads if key.endswith(".jsonl")})


def test_the_parts_of_a_run_the_view_owes_a_file_are_parsed(tmp_path):
    out = _out(tmp_path / "out")
    retryable = {"kind": "fetch", "message": "timeout", "retryable": True}
    write_shard(out, FP, RUN1, 0, [_record(0), _record(1), _record(2, error=retryable)])
    write_shard(out, FP, RUN1, 1, [_record(3), _record(3, question="other")])
    assert out.exists(view_owed_key(FP, RUN1)) and not list(out.iter_objects(prefix=PARQUET_VIEW_PREFIX))

    done, watched = _load(out)
    assert _parts_read(watched) == [part_key(FP, RUN1, 0), part_key(FP, RUN1, 1)]
    assert len(done) == 4  # final records only
    assert done.pending_by_listing(_item(0), ("q", "new")) == ("new",)
    assert done.pending_by_listing(_item(2), ("q",)) == ("q",)  # a retryable failure is not done
    assert done.pending_by_listing(_item(0, etag="changed"), ("q",)) == ("q",)
    assert done.pending_by_content(_item(0).id, f"{0:064x}", ("q",)) == ()
    assert done.pending_by_listing(_item(3), ("q", "other")) == ()

    # A part that cannot be read is skipped, named: its items are computed again.
    out.write(part_key(FP, RUN1, 2), b"\xff\xfe not text")
    loaded = load_rows(out, FP)
    assert loaded.unreadable == [part_key(FP, RUN1, 2)] and sum(len(s.rows) for s in loaded.sources) == 4


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_once_a_runs_view_file_is_written_a_load_reads_its_columns_and_no_part(tmp_path, where, request):
    if where == "s3":
        request.getfixturevalue("s3_client").create_bucket(Bucket="view")
        out = open_storage("s3://view/out/")
    else:
        out = _out(tmp_path / "out")
    parts = [write_shard(out, FP, RUN1, shard, [_record(2 * shard), _record(2 * shard + 1)]) for shard in range(3)]
    export_after_run.fn(out, out.uri, FP, RUN1, parts)
    assert out.exists(run_parquet_key(RUN1)) and not out.exists(view_owed_key(FP, RUN1))

    done, watched = _load(out)  # a night with nothing new: the marks, the view files, their columns
    assert len(done) == 6 and _done(done, 0, 5)
    assert watched.listed == [view_owed_prefix(FP), PARQUET_VIEW_PREFIX]
    assert set(watched.reads) == {run_parquet_key(RUN1)}

    # A run that wrote since and has no view file yet: its parts are parsed, no other.
    write_shard(out, FP, RUN2, 0, [_record(100)])
    done, watched = _load(out)
    assert len(done) == 7 and _done(done, 0, 5, 100)
    assert part_prefix(FP, RUN2) in watched.listed and results_prefix(FP) not in watched.listed
    assert _parts_read(watched) == [part_key(FP, RUN2, 0)]


def test_with_no_view_file_of_the_fingerprint_every_part_is_parsed(tmp_path):
    out = _out(tmp_path / "out")
    parts = [write_shard(out, FP, RUN1, shard, [_record(shard)]) for shard in range(3)]
    add_run(out, FP, RUN1, parts, earlier=DoneIndex())
    other = "e" * 16  # another job's view file: no row of FP
    add_run(out, other, RUN2, [write_shard(out, other, RUN2, 0, [_record(9, fingerprint=other)])],
            earlier=DoneIndex())
    out.delete(run_parquet_key(RUN1))  # deleted by hand; no mark says a run is owed

    done, watched = _load(out)
    assert len(done) == 3 and _done(done, 0, 1, 2) and not _done(done, 9)
    assert results_prefix(FP) in watched.listed
    assert _parts_read(watched) == [part_key(FP, RUN1, shard) for shard in range(3)]


class RunEndsBetweenListings:
    """The output, where run RUN2 writes its view file and removes its mark right after the
    load's first listing of the marks or of the view files, before the other."""

    def __init__(self, inner: Storage, parts: list[str]):
        self.inner, self.parts, self.ended = inner, parts, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def iter_objects(self, glob=None, prefix="", start_after=""):
        listed = list(self.inner.iter_objects(glob, prefix, start_after))
        if prefix in (view_owed_prefix(FP), PARQUET_VIEW_PREFIX) and not self.ended:
            self.ended = True
            add_run(self.inner, FP, RUN2, self.parts, earlier=DoneIndex())
        return iter(listed)


def test_the_owed_marks_are_listed_before_the_view_files(tmp_path):
    """Listed the other way round, the run's file would be missed and then its mark: its
    results would count as not done."""
    out = _out(tmp_path / "out")
    add_run(out, FP, RUN1, [write_shard(out, FP, RUN1, 0, [_record(0)])], earlier=DoneIndex())
    parts = [write_shard(out, FP, RUN2, 0, [_record(1)])]
    racing = RunEndsBetweenListings(out, parts)
    done = load_done_index.fn(racing, FP)
    assert racing.ended and not out.exists(view_owed_key(FP, RUN2)) and out.exists(run_parquet_key(RUN2))
    assert _done(done, 0, 1)


def test_a_view_file_without_the_hash_columns_gives_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = _out(tmp_path / "out")
    group = ResultRecord(**{**_record(7).model_dump(), "sha256": None, "members": [
        {"key": "g/a.jpg", "size": 3, "etag": "ea"}, {"key": "g/b.jpg", "size": 4, "etag": "eb"}]})
    records = [_record(0), _record(1, question=None), _record(2, error={"kind": "decode", "message": "bad"}), group]
    add_run(out, FP, RUN1, [write_shard(out, FP, RUN1, 0, records)], earlier=DoneIndex())
    hashed = load_rows(out, FP).sources

    table = pq.read_table(tmp_path / "out" / run_parquet_key(RUN1))
    older = table.drop_columns(list(VIEW_HASHES))
    assert not set(VIEW_HASHES) & set(older.column_names)
    out.write(run_parquet_key(RUN1), _parquet_bytes(pa, pq, older))
    computed = load_rows(out, FP).sources
    assert [s.key for s in computed] == [s.key for s in hashed] == [run_parquet_key(RUN1)]
    assert len(computed[0].rows) == 4 and computed[0].rows.tobytes() == hashed[0].rows.tobytes()


def _parquet_bytes(pa, pq, table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def test_a_part_whose_read_fails_for_a_moment_is_read_again_never_skipped(tmp_path, monkeypatch):
    """A part of a run the view owes a file is parsed; a read of it that fails transiently (a
    body cut short, a timeout) is tried again, and one that keeps failing fails the load (retried
    as a task) instead of leaving the part's results out, which a run would compute and write twice."""
    import vlm_caption.tasks.sources.s3_client as transient
    from vlm_caption.tasks.sources.storage import ShortBodyError

    monkeypatch.setattr(transient, "PAUSE_S", 0.01)
    out = _out(tmp_path / "out")
    write_shard(out, FP, RUN1, 0, [_record(0), _record(1)])
    read, failures = out.read, [0]

    def flaky(key: str) -> bytes:
        if key.endswith(".jsonl") and failures[0] > 0:
            failures[0] -= 1
            raise ShortBodyError(f"{key}: 10 of 900 bytes")
        return read(key)

    monkeypatch.setattr(out, "read", flaky)
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
    add_run(out, FP, RUN2, [write_shard(out, FP, RUN2, 0, mine[5:])], earlier=DoneIndex())
    done, watched = _load(out)
    assert len(done) == 6
    for original in mine:
        found = done.earlier_answer("q", sha256=original.sha256)
        assert (found.key, found.text, found.finish_reason, found.question) == (
            original.key, original.text, original.finish_reason, original.question)
    assert done.earlier_answer("other question", sha256=mine[0].sha256) is None
    assert not _parts_read(watched) and set(watched.reads) == {run_parquet_key(RUN1), run_parquet_key(RUN2)}


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_a_listing_under_a_prefix_that_ends_inside_a_name(tmp_path, where, request):
    """What a load lists an owed run's parts with (`part_prefix`): its parts and its partitions',
    not another run's whose id begins with it; the same on a folder and on S3."""
    if where == "s3":
        request.getfixturevalue("s3_client").create_bucket(Bucket="prefix")
        store = open_storage("s3://prefix/out/")
    else:
        store = _out(tmp_path / "out")
    for key in ["r/view-owed/x", "r/part-x-00000.jsonl", "r/part-x-p0-00000.jsonl", "r/part-xy-00000.jsonl"]:
        store.write(key, b"1")
    keys = lambda prefix: [ref.key for ref in store.iter_objects(prefix=prefix)]  # noqa: E731
    assert keys("r/part-x-") == ["r/part-x-00000.jsonl", "r/part-x-p0-00000.jsonl"]
    assert keys("r/view-owed/") == ["r/view-owed/x"] and keys("r/nothing-") == []


def test_an_empty_index_has_everything_pending():
    done = DoneIndex()
    assert len(done) == 0 and done.pending_by_listing(_item(1), ("q",)) == ("q",)
    assert done.pending_by_content("x", "abc", ("q",)) == ("q",)


def _view_rows(records: list[ResultRecord]) -> list[dict]:
    """The records' view rows, as `add_run` writes them."""
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
