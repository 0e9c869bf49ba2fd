"""The Parquet view (tasks/results/parquet_view.py): parts written as the writers write them
(the run's view-owed mark, then the part), the view under <out>/parquet/ read as ONE dataset by
pyarrow.dataset, pandas, `datasets` (and DuckDB where installed). After every step it holds
exactly the results the parts hold, each once, the latest, with the done-index's row of each in
its hash columns, and the done-index (which reads those columns) counts exactly them. No engine
starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from vlm_caption.flows.cli import main
from vlm_caption.tasks.results import parquet_view
from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.results.done_index import read_done_index
from vlm_caption.tasks.results.done_rows import load_rows, read_part_rows, record_row, result_key
from vlm_caption.tasks.results.layout import VIEW_HASHES, part_key, part_prefix, partition_parts_id, run_parquet_key
from vlm_caption.tasks.results.parquet import record_from_row, results_schema, view_row
from vlm_caption.tasks.results.parquet_view import add_run, compact_view
from vlm_caption.tasks.records import Member, ResultRecord
from vlm_caption.tasks.results.writers import write_manifest, write_shard
from vlm_caption.tasks.sources.items import ObjectRef, WorkItem
from tests.test_parquet_export import FP, RUN1, RUN2, out, record
from tests.recording_storage import RecordingStorage

RUN3 = "cccc3333-20260103T000000"
RUN4 = "dddd4444-20260104T000000"
STAMP = re.compile(r"\d{8}T\d{6}")


def reuploaded(key: str, run_id: str, text: str, **fields) -> ResultRecord:
    """A result computed again because the object changed (another etag and content)."""
    return record(key, run_id, text, **fields).model_copy(update={"etag": "new-" + key, "sha256": "t" * 64})


def files(output) -> set[str]:
    folder = Path(output) / "parquet"
    return {p.name for p in folder.glob("*.parquet")} if folder.is_dir() else set()


def view_rows(output) -> list[dict]:
    return pads.dataset(str(Path(output) / "parquet"), format="parquet").to_table().to_pylist()


def latest_results(output) -> dict[tuple[str, str, str], tuple[str, str | None]]:
    """What the view must hold, read here from the parts themselves: each final record, the
    latest run's (its stamp, then the part's name) where a result was computed more than once."""
    parts = sorted(Path(output, "results").glob("*/*.jsonl"),
                   key=lambda p: ((STAMP.search(p.name) or [""])[0], p.name))
    latest = {}
    for part in parts:
        for line in part.read_text().splitlines():
            try:
                r = ResultRecord.model_validate_json(line)
            except ValueError:
                continue  # a line cut short
            if r.is_final:
                latest[(r.fingerprint, r.key, r.question or "")] = (r.run_id, r.text)
    return latest


def done_keys(output) -> set[int]:
    """The result keys the done-index counts now (the view's hash columns, the owed runs' parts)."""
    return {key for source in load_rows(out(output), FP).sources for key in source.rows["key"].tolist()}


def assert_view_is_the_done_index(output) -> list[dict]:
    """The view read as one (pyarrow.dataset, pandas, DuckDB where installed) holds every final
    result of the parts, once, and it is the latest; each row's hash columns are its record's
    done-index row, and the done-index counts exactly the view's results."""
    rows = view_rows(output)
    found = [(r["fingerprint"], r["key"], r["question"] or "") for r in rows]
    assert len(found) == len(set(found)), f"a result appears twice: {sorted(found)}"
    o = out(output)
    parsed, _ = read_part_rows(o, list(o.iter_objects(prefix=f"results/{FP}/part-")), get_logger())
    keys = {result_key(key, question) for _, key, question in found}
    assert keys == set(np.concatenate(list(parsed.values()))["key"].tolist()) == done_keys(output)
    assert [tuple(r[name] for name in VIEW_HASHES) for r in rows] == [record_row(record_from_row(r)) for r in rows]
    assert {ident: (r["run_id"], r["caption"]) for ident, r in zip(found, rows)} == latest_results(output)
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


def first_run(output) -> None:
    """Run 1: a; b, a failure a rerun would only repeat; c, a retryable one (not in the view); d
    asked a question of its own."""
    o = out(output)
    parts = [write_shard(o, FP, RUN1, 0, [
        record("a.jpg", RUN1, "first caption"),
        record("b.jpg", RUN1, None, {"kind": "decode", "message": "not an image", "retryable": False}),
        record("c.jpg", RUN1, None, {"kind": "fetch", "message": "timed out", "retryable": True}),
    ]), write_shard(o, FP, RUN1, 1, [record("d.jpg", RUN1, "a dog", question="What animal?")])]
    write_manifest.fn(o, RUN1, {"run_id": RUN1, "parameters": {"source": "s3://media/photos/"}})
    report = add_run(o, FP, RUN1, parts)
    assert report["path"] == str(Path(output) / run_parquet_key(RUN1)) and report["rows"] == 3 and report["complete"]


def test_the_view_grows_by_the_runs_results_and_holds_each_once(tmp_path):
    output = tmp_path / "out"
    first_run(output)
    assert files(output) == {f"run-{RUN1}.parquet"}
    assert_view_is_the_done_index(output)

    # A rerun with nothing new: nothing listed, read or written; the view is as it was.
    before = {p.name: p.stat().st_mtime_ns for p in (output / "parquet").iterdir()}
    watched = Watched(out(output))
    assert add_run(watched, FP, RUN2, [])["path"] is None
    assert watched.calls == [] and {p.name: p.stat().st_mtime_ns for p in (output / "parquet").iterdir()} == before

    # One object re-uploaded (a computed again), c's fetch succeeding now, e new: run 2's file
    # holds the three, and run 1's file is rewritten without its a.
    o = out(output)
    part = write_shard(o, FP, RUN2, 0, [reuploaded("a.jpg", RUN2, "second caption"),
                                            record("c.jpg", RUN2, "a cup"), record("e.jpg", RUN2, "an egg")])
    report = add_run(o, FP, RUN2, [part])
    assert report["rows"] == 3 and report["rewritten"] == {str(output / run_parquet_key(RUN1)): 1}
    assert files(output) == {f"run-{RUN1}.parquet", f"run-{RUN2}.parquet"}
    rows = {r["key"]: r for r in assert_view_is_the_done_index(output)}
    assert (rows["a.jpg"]["caption"], rows["a.jpg"]["etag"]) == ("second caption", "new-a.jpg")

    # Compaction: one file, the same rows, no part read.
    report = compact_view(out(output))
    assert len(report["merged"]) == 2 and report["rows"] == 5 and report["duplicates_dropped"] == 0
    (merged,) = files(output)
    assert merged.startswith("compacted-")
    assert pq.ParquetFile(output / "parquet" / merged).metadata.num_row_groups == 1  # runs' rows gathered
    assert_view_is_the_done_index(output)

    # A result the compacted file holds is computed again: that file is rewritten.
    part = write_shard(o, FP, RUN3, 0, [reuploaded("d.jpg", RUN3, "a wolf", question="What animal?")])
    report = add_run(o, FP, RUN3, [part])
    assert report["rewritten"] == {str(output / "parquet" / merged): 1}
    assert files(output) == {merged, f"run-{RUN3}.parquet"}
    rows = assert_view_is_the_done_index(output)
    assert {r["key"]: r["caption"] for r in rows}["d.jpg"] == "a wolf"

    # `datasets` reads the folder's files as one dataset too.
    from datasets import load_dataset

    dataset = load_dataset("parquet", data_files=f"{output}/parquet/*.parquet", split="train",
                           cache_dir=str(tmp_path / "hf-cache"))
    assert sorted((r["key"], r["run_id"]) for r in dataset) == sorted((r["key"], r["run_id"]) for r in rows)
    assert {r["key"]: r["source"] for r in dataset}["b.jpg"] == "s3://media/photos/"


def test_a_result_left_twice_is_settled_by_compaction(tmp_path, monkeypatch):
    """A run whose rewrite of an older file fails (or that dies between its own file and the
    rewrite) says so in its report; compaction keeps the latest of the two."""
    output = tmp_path / "out"
    first_run(output)

    def broken(*args):
        raise OSError("access denied")

    monkeypatch.setattr(parquet_view, "_drop_rows", broken)
    part = write_shard(out(output), FP, RUN2, 0, [reuploaded("a.jpg", RUN2, "second caption")])
    report = add_run(out(output), FP, RUN2, [part])
    assert report["not_rewritten"] == {str(output / run_parquet_key(RUN1)): "OSError: access denied"}
    assert sorted(r["key"] for r in view_rows(output)) == ["a.jpg", "a.jpg", "b.jpg", "d.jpg"]

    assert main(["export", str(output), "--compact"]) == 0
    assert len(files(output)) == 1
    rows = {r["key"]: r for r in assert_view_is_the_done_index(output)}
    assert rows["a.jpg"]["run_id"] == RUN2


def test_a_fanned_out_run_adds_every_partitions_parts_each_result_once(tmp_path):
    """Partition 1 wrote shard 1 and shard 2 and died before its report (its parts are not in
    the run's list); partition 0 took shard 1 over and wrote it again. The run's file holds
    shard 2's result and shard 1's once."""
    output = tmp_path / "out"
    o = out(output)
    p0, p1 = partition_parts_id(RUN1, 0), partition_parts_id(RUN1, 1)
    write_shard(o, FP, p1, 1, [record("x.jpg", p1, "x by p1")])
    write_shard(o, FP, p1, 2, [record("y.jpg", p1, "y by p1")])
    parts = [write_shard(o, FP, p0, 0, [record("w.jpg", p0, "w")]),
             write_shard(o, FP, p0, 1, [record("x.jpg", p0, "x by p0")])]
    report = add_run(o, FP, RUN1, parts)
    assert report["rows"] == 3 and files(output) == {f"run-{RUN1}.parquet"}
    assert sorted(r["key"] for r in assert_view_is_the_done_index(output)) == ["w.jpg", "x.jpg", "y.jpg"]


def test_a_part_cut_short_after_its_runs_view_file_changes_nothing_and_the_cli_rebuilds_the_view(tmp_path, capsys):
    """A part cut short by hand after its run's view file was written: the done-index reads the
    view, which still holds the cut records, so nothing is computed again. `vlm-caption export
    OUT` makes the view again from every part, as one file, and names the cut part as damaged."""
    output = tmp_path / "out"
    first_run(output)
    o = out(output)
    before = done_keys(output)
    cut = output / part_key(FP, RUN1, 0)
    lines = cut.read_bytes().splitlines(keepends=True)
    cut.write_bytes(lines[0] + lines[1][:30])  # a.jpg stays; b.jpg cut mid-line, c.jpg lost
    assert done_keys(output) == before
    index = read_done_index(o, FP)
    assert set(index.holding(np.array([result_key("b.jpg", None)], np.uint64))) == {run_parquet_key(RUN1)}
    b = WorkItem("b.jpg", (ObjectRef("b.jpg", 10, "e-b.jpg"),))
    assert index.pending_by_listing(b, ("",)) == ()  # b.jpg is not computed again

    assert main(["export", str(output)]) == 1  # the cut part is named: the view holds what it still has
    printed = json.loads(capsys.readouterr().out)
    assert list(printed["damaged_parts"]) == [str(cut)] and printed["complete"] is False
    assert printed["replaced"] == [str(output / run_parquet_key(RUN1))] and printed["rows"] == 2
    assert len(files(output)) == 1
    assert_view_is_the_done_index(output)


def test_compaction_of_a_file_without_hash_columns_and_a_new_one_gives_the_records_rows(tmp_path):
    """A view file written before the hash columns existed (written here with pyarrow) is read by
    the done-index as it is; compacted with a run's new file, the one file has every row's hash
    columns, equal to its record's done-index row (`record_row`), a group's members included."""
    import pyarrow as pa

    output = tmp_path / "out"
    o = out(output)
    group = record("g/", RUN1, "two cats").model_copy(update={"members": [
        Member(key="g/1.jpg", size=4, etag="e1"), Member(key="g/2.jpg", size=6, etag="e2")]})
    old = [record("a.jpg", RUN1, "first caption"), group]
    schema = pa.schema([field for field in results_schema() if field.name not in VIEW_HASHES])
    (output / "parquet").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([view_row(r, None) for r in old], schema=schema),
                   output / run_parquet_key(RUN1))
    assert done_keys(output) == {result_key(r.key, None) for r in old}
    new = [record("e.jpg", RUN2, "an egg")]
    add_run(o, FP, RUN2, [write_shard(o, FP, RUN2, 0, new)])

    assert len(compact_view(o)["merged"]) == 2
    (merged,) = files(output)
    table = pq.read_table(output / "parquet" / merged)
    assert table.schema.equals(results_schema())
    rows = {r["key"]: tuple(r[name] for name in VIEW_HASHES) for r in table.to_pylist()}
    assert rows == {r.key: record_row(r) for r in old + new}


def test_s3_view(s3_client):
    """The same on an object store: the run's file, the older one rewritten, read as one."""
    import io

    import pyarrow as pa

    s3_client.create_bucket(Bucket="view-out")
    o = out("s3://view-out/runs/")
    first = write_shard(o, FP, RUN1, 0, [record("a.jpg", RUN1, "first"), record("b.jpg", RUN1, "bee")])
    add_run(o, FP, RUN1, [first])
    second = write_shard(o, FP, RUN2, 0, [reuploaded("a.jpg", RUN2, "second")])
    report = add_run(o, FP, RUN2, [second])
    assert report["path"] == f"s3://view-out/runs/{run_parquet_key(RUN2)}"
    assert report["rewritten"] == {f"s3://view-out/runs/{run_parquet_key(RUN1)}": 1}
    keys = [obj["Key"] for obj in s3_client.list_objects_v2(Bucket="view-out", Prefix="runs/parquet/")["Contents"]]
    table = pa.concat_tables(pq.read_table(io.BytesIO(s3_client.get_object(Bucket="view-out", Key=key)["Body"].read()))
                             for key in keys)
    assert sorted(zip(table.column("key").to_pylist(), table.column("caption").to_pylist())) == [
        ("a.jpg", "second"), ("b.jpg", "bee")]


def test_a_runs_step_reads_only_its_own_parts_and_takes_the_earlier_ones_from_its_done_index(tmp_path):
    """At a run's end the step asks the done-index the run loaded at its start which earlier
    results it computed again and in which view files they stand: it lists and reads only the
    run's own parts under results/ (no part of the history), and the latest result still wins."""
    from vlm_caption.tasks.results.done_index import load_done_index, loaded_index

    output = tmp_path / "out"
    first_run(output)
    o = out(output)
    load_done_index.fn(o, FP)  # as the run does at its start
    part = write_shard(o, FP, RUN2, 0, [reuploaded("a.jpg", RUN2, "second caption"), record("e.jpg", RUN2, "egg")])
    watched = RecordingStorage(o)
    report = add_run(watched, FP, RUN2, [part])
    assert report["rows"] == 2 and report["rewritten"] == {str(output / run_parquet_key(RUN1)): 1}
    assert [p for p in watched.listed if p.startswith("results/")] == [part_prefix(FP, RUN2)]
    assert {k for k in watched.reads if k.startswith("results/")} == {part_key(FP, RUN2, 0)}
    assert loaded_index(o, FP) is None  # handed over once
    rows = {r["key"]: r for r in assert_view_is_the_done_index(output)}
    assert (rows["a.jpg"]["run_id"], rows["a.jpg"]["caption"]) == (RUN2, "second caption")


def test_a_result_replaced_twice_in_a_fanned_out_run_and_one_in_a_compacted_file_each_stay_once(tmp_path):
    """The run's done-index from its start, and parts of the run that a partition's later load
    held too (the run's own parts are never earlier results of it): a result whose earlier
    record is in a compacted file has that file rewritten; two partitions' records of one
    result leave the latest."""
    from vlm_caption.tasks.results.done_index import load_done_index

    output = tmp_path / "out"
    first_run(output)
    o = out(output)
    compact_view(o)
    (merged,) = files(output)
    p0, p1 = partition_parts_id(RUN3, 0), partition_parts_id(RUN3, 1)
    start = load_done_index.fn(o, FP)
    parts = [write_shard(o, FP, p1, 1, [reuploaded("a.jpg", p1, "a by p1")])]
    load_done_index.fn(o, FP)  # partition 0 loads again after its shards (it sees p1's part)
    parts.append(write_shard(o, FP, p0, 1, [reuploaded("a.jpg", p0, "a by p0"), record("g.jpg", p0, "a goat")]))
    report = add_run(o, FP, RUN3, parts, earlier=start)
    assert report["rows"] == 2 and report["rewritten"] == {str(output / "parquet" / merged): 1}
    rows = {r["key"]: r for r in assert_view_is_the_done_index(output)}
    assert rows["a.jpg"]["caption"] in ("a by p0", "a by p1") and sorted(rows) == ["a.jpg", "b.jpg", "d.jpg", "g.jpg"]


def test_a_run_killed_before_its_view_file_is_added_by_the_next_run(tmp_path):
    """Run 1 writes its parts and is killed before its view file (the view owes it one); run 2,
    with nothing new, adds run 1's file and says the view is complete. Run 3 replaces one of run
    1's results after run 2 was killed too: run 2's owed file first, then run 3's own, each result
    once, the latest."""
    from vlm_caption.tasks.results.parquet_view import export_after_run

    output = tmp_path / "out"
    o = out(output)
    write_shard(o, FP, RUN1, 0, [record("a.jpg", RUN1, "first caption"), record("b.jpg", RUN1, "a bee")])
    write_shard(o, FP, RUN1, 1, [record("d.jpg", RUN1, "a dog")])
    assert files(output) == set() and (output / "results" / FP / "view-owed" / RUN1).exists()

    report = export_after_run.fn(out(output), str(output), FP, RUN2, [])
    assert report["complete"] and report["repaired"][RUN1]["rows"] == 3 and report["path"] is None
    assert files(output) == {f"run-{RUN1}.parquet"}
    assert not list((output / "results" / FP / "view-owed").iterdir())
    assert_view_is_the_done_index(output)

    write_shard(o, FP, RUN2, 0, [record("e.jpg", RUN2, "an egg")])  # run 2 killed after its part
    part = write_shard(o, FP, RUN3, 0, [reuploaded("a.jpg", RUN3, "second caption")])
    report = export_after_run.fn(out(output), str(output), FP, RUN3, [part])
    assert report["complete"] and report["repaired"][RUN2]["rows"] == 1 and report["rows"] == 1
    assert files(output) == {f"run-{RUN1}.parquet", f"run-{RUN2}.parquet", f"run-{RUN3}.parquet"}
    rows = assert_view_is_the_done_index(output)
    assert {r["key"]: r["caption"] for r in rows} == {"a.jpg": "second caption", "b.jpg": "a bee", "d.jpg": "a dog",
                                                      "e.jpg": "an egg"}

    # `vlm-caption export` (the view made again from every part) leaves nothing owed: a run
    # killed now has its results in the rebuilt file, and a later run adds no file of it again.
    write_shard(o, FP, RUN4, 0, [record("f.jpg", RUN4, "a fig")])
    assert main(["export", str(output)]) == 0
    assert not list((output / "results" / FP / "view-owed").iterdir())
    assert "repaired" not in export_after_run.fn(out(output), str(output), FP, RUN4 + "x", [])
    assert_view_is_the_done_index(output)

    # Nothing owed: a run with nothing new lists the owed folder once and writes nothing.
    watched = Watched(out(output))
    assert export_after_run.fn(watched, str(output), FP, RUN4, []) == {"path": None, "rows": 0, "complete": True,
                                                                        "seconds": 0.0}
    assert watched.calls == ["iter_objects"]
