"""The Parquet view (tasks/results/parquet_view.py): parts written as the writers write them, in
the view's folder of their fingerprint, folded at a run's end into the run's file; the view under
<out>/parquet/ read as ONE dataset by pyarrow.dataset, pandas, `datasets` (and DuckDB where
installed). After every fold it holds exactly the final results written, each once, the latest,
with the done-index's row of each in its hash columns, and the done-index (which reads those
columns) counts exactly them; before a fold (a run killed) the run's parts are in it. No engine
starts."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from vlm_caption.flows.cli import main
from vlm_caption.tasks.results import parquet_view
from vlm_caption.tasks.results.done_index import load_done_index, loaded_index, read_done_index
from vlm_caption.tasks.results.done_rows import load_rows, record_row, result_key
from vlm_caption.tasks.results.layout import (PARQUET_VIEW_PREFIX, VIEW_HASHES, part_key, parts_prefix,
                                              partition_parts_id, run_parquet_key)
from vlm_caption.tasks.results.parquet import part_order, record_from_row, results_schema, view_row
from vlm_caption.tasks.results.parquet_view import compact_view, export_after_run, fold_run, parts_by_run
from vlm_caption.tasks.records import Member, ResultRecord
from vlm_caption.tasks.results.writers import write_shard
from vlm_caption.tasks.sources.items import ObjectRef
from tests.test_parquet_export import FP, RUN1, RUN2, SOURCE, out, record
from tests.recording_storage import RecordingStorage

RUN3 = "cccc3333-20260103T000000"
RUN4 = "dddd4444-20260104T000000"
STAMP = re.compile(r"\d{8}T\d{6}")


class Ledger:
    """Every record a test wrote, with its part: what the view must hold is computed from it."""

    def __init__(self):
        self.written: list[tuple[tuple[str, str], int, ResultRecord]] = []

    def write(self, o, parts_id: str, shard: int, records: list[ResultRecord]) -> str:
        part = write_shard(o, FP, parts_id, shard, records, SOURCE)
        order = part_order(ObjectRef(part_key(FP, parts_id, shard), 0, ""))
        self.written += [(order, i, r) for i, r in enumerate(records)]
        return part

    def latest(self) -> dict[tuple[str, str, str], tuple[str, str | None]]:
        """Each final record, the latest run's (its stamp, then the part's name) where a result
        was computed more than once."""
        return {(r.fingerprint, r.key, r.question or ""): (r.run_id, r.text)
                for _, _, r in sorted(self.written, key=lambda w: (w[0], w[1])) if r.is_final}


def reuploaded(key: str, run_id: str, text: str, **fields) -> ResultRecord:
    """A result computed again because the object changed (another etag and content)."""
    return record(key, run_id, text, **fields).model_copy(update={"etag": "new-" + key, "sha256": "t" * 64})


def files(output) -> set[str]:
    folder = Path(output) / "parquet"
    return {p.name for p in folder.glob("*.parquet")} if folder.is_dir() else set()


def view_rows(output) -> list[dict]:
    return pads.dataset(str(Path(output) / "parquet"), format="parquet").to_table().to_pylist()


def done_keys(output) -> set[int]:
    """The result keys the done-index counts now (the view's hash columns, the parts not folded)."""
    return {key for source in load_rows(out(output), FP).sources for key in source.rows["key"].tolist()}


def fold(output, run: str, earlier=None) -> dict:
    """What a run's end does with run `run`'s parts."""
    o = out(output)
    return fold_run(o, FP, run, parts_by_run(o, FP).get(run, []),
                    earlier if earlier is not None else read_done_index(o, FP))


def assert_view_is_the_done_index(output, ledger: Ledger) -> list[dict]:
    """The view read as one (pyarrow.dataset, pandas, DuckDB where installed) holds every final
    result written, once, and it is the latest; each row's hash columns are its record's
    done-index row, and the done-index counts exactly the view's results."""
    assert not parts_by_run(out(output), FP), "a part is left: the view may hold a result twice"
    rows = view_rows(output)
    found = [(r["fingerprint"], r["key"], r["question"] or "") for r in rows]
    assert len(found) == len(set(found)), f"a result appears twice: {sorted(found)}"
    keys = {result_key(key, question) for _, key, question in found}
    assert keys == {result_key(key, question) for _, key, question in ledger.latest()} == done_keys(output)
    assert [tuple(r[name] for name in VIEW_HASHES) for r in rows] == [record_row(record_from_row(r)) for r in rows]
    assert {ident: (r["run_id"], r["caption"]) for ident, r in zip(found, rows)} == ledger.latest()
    pandas = pytest.importorskip("pandas")
    frame = pandas.read_parquet(Path(output) / "parquet")
    assert sorted(zip(frame["key"], frame["run_id"])) == sorted((r["key"], r["run_id"]) for r in rows)
    try:
        import duckdb
    except ImportError:
        return rows
    keys = duckdb.sql(f"select key, run_id from read_parquet('{output}/parquet/*.parquet')").fetchall()
    assert sorted(keys) == sorted((r["key"], r["run_id"]) for r in rows)
    return rows


class Watched:
    """A storage that records every call made to it (describe aside)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr) or name == "describe":
            return attr

        def call(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)
        return call


def first_run(output, ledger: Ledger) -> None:
    """Run 1: a; b, a failure a rerun would only repeat; c, a retryable one (not in the view); d
    asked a question of its own."""
    o = out(output)
    ledger.write(o, RUN1, 0, [
        record("a.jpg", RUN1, "first caption"),
        record("b.jpg", RUN1, None, {"kind": "decode", "message": "not an image", "retryable": False}),
        record("c.jpg", RUN1, None, {"kind": "fetch", "message": "timed out", "retryable": True}),
    ])
    ledger.write(o, RUN1, 1, [record("d.jpg", RUN1, "a dog", question="What animal?")])
    report = fold(output, RUN1)
    assert report["path"] == str(Path(output) / run_parquet_key(RUN1)) and report["rows"] == 3 and report["complete"]


def test_the_view_grows_by_the_runs_results_and_holds_each_once(tmp_path):
    output, ledger = tmp_path / "out", Ledger()
    first_run(output, ledger)
    assert files(output) == {f"run-{RUN1}.parquet"}
    assert_view_is_the_done_index(output, ledger)

    # A rerun with nothing new: one listing of its fingerprint's folder, nothing read or written.
    before = {p.name: p.stat().st_mtime_ns for p in (output / "parquet").glob("*.parquet")}
    watched = Watched(out(output))
    assert export_after_run.fn(watched, str(output), FP, RUN2)["path"] is None
    assert watched.calls == ["iter_objects"]
    assert {p.name: p.stat().st_mtime_ns for p in (output / "parquet").glob("*.parquet")} == before

    # One object re-uploaded (a computed again), c's fetch succeeding now, e new: run 2's file
    # holds the three, and run 1's file is rewritten without its a.
    ledger.write(out(output), RUN2, 0, [reuploaded("a.jpg", RUN2, "second caption"),
                                        record("c.jpg", RUN2, "a cup"), record("e.jpg", RUN2, "an egg")])
    report = fold(output, RUN2)
    assert report["rows"] == 3 and report["rewritten"] == {str(output / run_parquet_key(RUN1)): 1}
    assert files(output) == {f"run-{RUN1}.parquet", f"run-{RUN2}.parquet"}
    rows = {r["key"]: r for r in assert_view_is_the_done_index(output, ledger)}
    assert (rows["a.jpg"]["caption"], rows["a.jpg"]["etag"]) == ("second caption", "new-a.jpg")

    # Compaction: one file, the same rows.
    report = compact_view(out(output))
    assert len(report["merged"]) == 2 and report["rows"] == 5 and report["duplicates_dropped"] == 0
    (merged,) = files(output)
    assert merged.startswith("compacted-")
    assert pq.ParquetFile(output / "parquet" / merged).metadata.num_row_groups == 1  # runs' rows gathered
    assert_view_is_the_done_index(output, ledger)

    # A result the compacted file holds is computed again: that file is rewritten.
    ledger.write(out(output), RUN3, 0, [reuploaded("d.jpg", RUN3, "a wolf", question="What animal?")])
    report = fold(output, RUN3)
    assert report["rewritten"] == {str(output / "parquet" / merged): 1}
    assert files(output) == {merged, f"run-{RUN3}.parquet"}
    rows = assert_view_is_the_done_index(output, ledger)
    assert {r["key"]: r["caption"] for r in rows}["d.jpg"] == "a wolf"

    # `datasets` reads the folder's files as one dataset too.
    from datasets import load_dataset

    dataset = load_dataset("parquet", data_files=f"{output}/parquet/*.parquet", split="train",
                           cache_dir=str(tmp_path / "hf-cache"))
    assert sorted((r["key"], r["run_id"]) for r in dataset) == sorted((r["key"], r["run_id"]) for r in rows)
    assert {r["key"]: r["source"] for r in dataset}["b.jpg"] == SOURCE


def test_a_result_left_twice_is_settled_by_compaction(tmp_path, monkeypatch):
    """A run whose rewrite of an older file fails (or that dies between its own file and the
    rewrite) says so in its report; compaction keeps the latest of the two."""
    output, ledger = tmp_path / "out", Ledger()
    first_run(output, ledger)

    def broken(*args):
        raise OSError("access denied")

    monkeypatch.setattr(parquet_view, "_drop_rows", broken)
    ledger.write(out(output), RUN2, 0, [reuploaded("a.jpg", RUN2, "second caption")])
    report = fold(output, RUN2)
    assert report["not_rewritten"] == {str(output / run_parquet_key(RUN1)): "OSError: access denied"}
    assert sorted(r["key"] for r in view_rows(output)) == ["a.jpg", "a.jpg", "b.jpg", "d.jpg"]

    assert main(["export", str(output), "--compact"]) == 0
    assert len(files(output)) == 1
    rows = {r["key"]: r for r in assert_view_is_the_done_index(output, ledger)}
    assert rows["a.jpg"]["run_id"] == RUN2


def test_a_fanned_out_run_folds_every_partitions_parts_each_result_once(tmp_path):
    """Partition 1 wrote shard 1 and shard 2 and died before its report; partition 0 took shard 1
    over and wrote it again. The run's file holds shard 2's result and shard 1's once."""
    output, ledger = tmp_path / "out", Ledger()
    o = out(output)
    p0, p1 = partition_parts_id(RUN1, 0), partition_parts_id(RUN1, 1)
    ledger.write(o, p1, 1, [record("x.jpg", p1, "x by p1")])
    ledger.write(o, p1, 2, [record("y.jpg", p1, "y by p1")])
    ledger.write(o, p0, 0, [record("w.jpg", p0, "w")])
    ledger.write(o, p0, 1, [record("x.jpg", p0, "x by p0")])
    report = fold(output, RUN1)
    assert report["rows"] == 3 and files(output) == {f"run-{RUN1}.parquet"}
    assert sorted(r["key"] for r in assert_view_is_the_done_index(output, ledger)) == ["w.jpg", "x.jpg", "y.jpg"]


def test_compaction_of_a_file_without_hash_columns_and_a_new_one_gives_the_records_rows(tmp_path):
    """A view file written before the hash columns existed (written here with pyarrow) is read by
    the done-index as it is; compacted with a run's new file, the one file has every row's hash
    columns, equal to its record's done-index row (`record_row`), a group's members included."""
    import pyarrow as pa

    output = tmp_path / "out"
    group = record("g/", RUN1, "two cats").model_copy(update={"members": [
        Member(key="g/1.jpg", size=4, etag="e1"), Member(key="g/2.jpg", size=6, etag="e2")]})
    old = [record("a.jpg", RUN1, "first caption"), group]
    schema = pa.schema([field for field in results_schema() if field.name not in VIEW_HASHES])
    (output / "parquet").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([view_row(r, None) for r in old], schema=schema),
                   output / run_parquet_key(RUN1))
    assert done_keys(output) == {result_key(r.key, None) for r in old}
    new = [record("e.jpg", RUN2, "an egg")]
    Ledger().write(out(output), RUN2, 0, new)
    fold(output, RUN2)

    assert len(compact_view(out(output))["merged"]) == 2
    (merged,) = files(output)
    table = pq.read_table(output / "parquet" / merged)
    assert table.schema.equals(results_schema())
    rows = {r["key"]: tuple(r[name] for name in VIEW_HASHES) for r in table.to_pylist()}
    assert rows == {r.key: record_row(r) for r in old + new}


def test_s3_view(s3_client):
    """The same on an object store: the run's file, the older one rewritten, the parts gone, read as one."""
    import io

    import pyarrow as pa

    s3_client.create_bucket(Bucket="view-out")
    o = out("s3://view-out/runs/")
    write_shard(o, FP, RUN1, 0, [record("a.jpg", RUN1, "first"), record("b.jpg", RUN1, "bee")], SOURCE)
    fold_run(o, FP, RUN1, parts_by_run(o, FP)[RUN1], read_done_index(o, FP))
    write_shard(o, FP, RUN2, 0, [reuploaded("a.jpg", RUN2, "second")], SOURCE)
    report = fold_run(o, FP, RUN2, parts_by_run(o, FP)[RUN2], read_done_index(o, FP))
    assert report["path"] == f"s3://view-out/runs/{run_parquet_key(RUN2)}"
    assert report["rewritten"] == {f"s3://view-out/runs/{run_parquet_key(RUN1)}": 1}
    keys = [obj["Key"] for obj in s3_client.list_objects_v2(Bucket="view-out", Prefix="runs/parquet/")["Contents"]]
    assert set(keys) == {f"runs/{run_parquet_key(RUN1)}", f"runs/{run_parquet_key(RUN2)}"}
    table = pa.concat_tables(pq.read_table(io.BytesIO(s3_client.get_object(Bucket="view-out", Key=key)["Body"].read()))
                             for key in keys)
    assert sorted(zip(table.column("key").to_pylist(), table.column("caption").to_pylist())) == [
        ("a.jpg", "second"), ("b.jpg", "bee")]


def test_a_runs_fold_reads_only_its_own_parts_and_takes_the_earlier_ones_from_its_done_index(tmp_path):
    """At a run's end the fold asks the done-index the run loaded at its start which earlier
    results it computed again and in which view files they stand: it reads only the run's own
    parts and the files it rewrites, and the latest result still wins."""
    output, ledger = tmp_path / "out", Ledger()
    first_run(output, ledger)
    o = out(output)
    load_done_index.fn(o, FP)  # as the run does at its start
    ledger.write(o, RUN2, 0, [reuploaded("a.jpg", RUN2, "second caption"), record("e.jpg", RUN2, "egg")])
    watched = RecordingStorage(o)
    report = export_after_run.fn(watched, str(output), FP, RUN2)
    assert report["rows"] == 2 and report["rewritten"] == {str(output / run_parquet_key(RUN1)): 1}
    assert watched.listed == [parts_prefix(FP), PARQUET_VIEW_PREFIX]
    assert set(watched.reads) == {part_key(FP, RUN2, 0), run_parquet_key(RUN1)}
    assert loaded_index(o, FP) is None  # handed over once
    rows = {r["key"]: r for r in assert_view_is_the_done_index(output, ledger)}
    assert (rows["a.jpg"]["run_id"], rows["a.jpg"]["caption"]) == (RUN2, "second caption")


def test_a_result_replaced_twice_in_a_fanned_out_run_and_one_in_a_compacted_file_each_stay_once(tmp_path):
    """The run's done-index from its start, and parts of the run that a partition's later load
    held too (the run's own parts are never earlier results of it): a result whose earlier
    record is in a compacted file has that file rewritten; two partitions' records of one
    result leave the latest."""
    output, ledger = tmp_path / "out", Ledger()
    first_run(output, ledger)
    o = out(output)
    compact_view(o)
    (merged,) = files(output)
    p0, p1 = partition_parts_id(RUN3, 0), partition_parts_id(RUN3, 1)
    start = load_done_index.fn(o, FP)
    ledger.write(o, p1, 1, [reuploaded("a.jpg", p1, "a by p1")])
    load_done_index.fn(o, FP)  # partition 0 loads again after its shards (it sees p1's part)
    ledger.write(o, p0, 1, [reuploaded("a.jpg", p0, "a by p0"), record("g.jpg", p0, "a goat")])
    report = fold(output, RUN3, earlier=start)
    assert report["rows"] == 2 and report["rewritten"] == {str(output / "parquet" / merged): 1}
    rows = {r["key"]: r for r in assert_view_is_the_done_index(output, ledger)}
    assert sorted(rows) == ["a.jpg", "b.jpg", "d.jpg", "g.jpg"]


def test_a_killed_runs_parts_are_in_the_view_and_the_next_run_folds_them(tmp_path):
    """Run 1 writes its parts and is killed before its fold: the view (read as one dataset) holds
    its results already, and the done-index counts them. Run 2, with nothing new, folds them and
    says the view is complete. Run 3 replaces one of run 1's results after run 2 was killed too:
    run 2's parts first, then run 3's own, each result once, the latest. `vlm-caption export`
    folds what a run left and compacts."""
    output, ledger = tmp_path / "out", Ledger()
    o = out(output)
    ledger.write(o, RUN1, 0, [record("a.jpg", RUN1, "first caption"), record("b.jpg", RUN1, "a bee")])
    ledger.write(o, RUN1, 1, [record("d.jpg", RUN1, "a dog")])
    assert files(output) == set() and sorted(r["key"] for r in view_rows(output)) == ["a.jpg", "b.jpg", "d.jpg"]
    assert done_keys(output) == {result_key(k, None) for k in ("a.jpg", "b.jpg", "d.jpg")}

    report = export_after_run.fn(out(output), str(output), FP, RUN2)
    assert report["complete"] and report["repaired"][RUN1]["rows"] == 3 and report["path"] is None
    assert files(output) == {f"run-{RUN1}.parquet"}
    assert_view_is_the_done_index(output, ledger)

    ledger.write(o, RUN2, 0, [record("e.jpg", RUN2, "an egg")])  # run 2 killed after its part
    ledger.write(o, RUN3, 0, [reuploaded("a.jpg", RUN3, "second caption")])
    report = export_after_run.fn(out(output), str(output), FP, RUN3)
    assert report["complete"] and report["repaired"][RUN2]["rows"] == 1 and report["rows"] == 1
    assert files(output) == {f"run-{RUN1}.parquet", f"run-{RUN2}.parquet", f"run-{RUN3}.parquet"}
    rows = assert_view_is_the_done_index(output, ledger)
    assert {r["key"]: r["caption"] for r in rows} == {"a.jpg": "second caption", "b.jpg": "a bee", "d.jpg": "a dog",
                                                      "e.jpg": "an egg"}

    ledger.write(o, RUN4, 0, [record("f.jpg", RUN4, "a fig")])  # killed too
    assert main(["export", str(output)]) == 0
    assert len(files(output)) == 1 and not parts_by_run(o, FP)
    assert_view_is_the_done_index(output, ledger)
    assert "repaired" not in export_after_run.fn(out(output), str(output), FP, RUN4 + "x")


def test_runs_killed_one_after_the_other_are_folded_oldest_first(tmp_path):
    """Two killed runs left parts with a result each; the later run (whose id sorts first: the
    random part of an id comes before its stamp) computed it again. Folded by stamp, the later
    answer stays, once."""
    output, ledger = tmp_path / "out", Ledger()
    assert RUN2 < RUN1  # (the ids' order is not the runs')
    ledger.write(out(output), RUN1, 0, [record("a.jpg", RUN1, "first caption")])
    ledger.write(out(output), RUN2, 0, [reuploaded("a.jpg", RUN2, "second caption")])
    report = export_after_run.fn(out(output), str(output), FP, RUN3)
    assert list(report["repaired"]) == [RUN1, RUN2] and report["complete"]
    rows = assert_view_is_the_done_index(output, ledger)
    assert [(r["key"], r["caption"]) for r in rows] == [("a.jpg", "second caption")]
