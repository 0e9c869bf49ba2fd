"""The one-file Parquet export (tasks/results/parquet.py, `vlm-caption export OUTPUT --to PATH`)
and the run's end step that folds its parts into the view (tasks/results/parquet_view.py; the view
itself is tests/test_parquet_view.py): parts written with the project's own writer, read back with
`datasets`, pyarrow and pandas. No engine starts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from vlm_caption.flows.cli import main
from vlm_caption.tasks.results import parquet, parquet_view
from vlm_caption.tasks.results.done_rows import record_row
from vlm_caption.tasks.results.layout import VIEW_HASHES, part_key, run_parquet_key
from vlm_caption.tasks.results.parquet import export_parquet
from vlm_caption.tasks.results.parquet_view import export_after_run
from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.writers import write_manifest, write_shard
from vlm_caption.tasks.sources.storage import Storage, open_storage

FP = "0123456789abcdef"
RUN1 = "aaaa1111-20260101T000000"
RUN2 = "0000ffff-20260102T000000"  # later, though its random prefix sorts first
ONE_FILE = "export/results.parquet"  # where these tests write the one-file export, in the output
SOURCE = "s3://media/photos/"  # the job's source, every row's `source`


def record(key: str, run_id: str, text: str | None = "a cat", error: dict | None = None,
           question: str | None = None) -> ResultRecord:
    return ResultRecord(key=key, size=10, etag="e-" + key, sha256="s" * 64, recipe="llava", model="tiny-llava",
                        question=question, prompt="USER: <image>\nDescribe. ASSISTANT:", text=text,
                        finish_reason="stop" if text else None, prompt_tokens=5, output_tokens=3, error=error,
                        timings={"fetch_s": 0.01, "decode_s": 0.02, "generate_s": 0.3},
                        fingerprint=FP, run_id=run_id)


def out(output) -> Storage:
    """The output's storage, as a run's plan hands it down."""
    return open_storage(str(output), create=True)


def write_history(output: str) -> None:
    """Run 1: a, b (a final error), c (a retryable error); run 2 computes a again."""
    output = out(output)
    write_shard(output, FP, RUN1, 0, [
        record("a.jpg", RUN1, "first caption"),
        record("b.jpg", RUN1, None, {"kind": "decode", "message": "not an image", "retryable": False}),
        record("c.jpg", RUN1, None, {"kind": "fetch", "message": "timed out", "retryable": True}),
    ], SOURCE)
    write_shard(output, FP, RUN1, 1, [record("d.jpg", RUN1, "a dog", question="What animal?")], SOURCE)
    write_shard(output, FP, RUN2, 0, [record("a.jpg", RUN2, "second caption")], SOURCE)


def by_key(rows: list[dict]) -> dict[str, dict]:
    return {row["key"]: row for row in rows}


def check_rows(rows: list[dict]) -> None:
    rows = by_key(rows)
    assert sorted(rows) == ["a.jpg", "b.jpg", "d.jpg"]  # c's error is retryable: not final
    assert rows["a.jpg"]["caption"] == "second caption" and rows["a.jpg"]["run_id"] == RUN2
    assert rows["b.jpg"]["caption"] is None
    assert (rows["b.jpg"]["error_kind"], rows["b.jpg"]["error_message"]) == ("decode", "not an image")
    assert rows["d.jpg"]["question"] == "What animal?" and rows["d.jpg"]["source"] == SOURCE
    assert rows["d.jpg"]["timings"]["generate_s"] == pytest.approx(0.3)
    assert {"model", "recipe", "fingerprint", "prompt_tokens", "output_tokens"} <= set(rows["a.jpg"])
    # the done-index's row of the record, which the done-index reads from the view
    assert tuple(rows["d.jpg"][name] for name in VIEW_HASHES) == record_row(
        record("d.jpg", RUN1, "a dog", question="What animal?"))


def test_folder_export_reads_back_with_datasets_pyarrow_and_pandas(tmp_path):
    from datasets import load_dataset

    output = str(tmp_path / "out")
    write_history(output)
    report = export_parquet(out(output), out(output), ONE_FILE, row_group_rows=2)
    path = Path(output) / ONE_FILE
    assert report["path"] == str(path) and report["rows"] == 3 and report["complete"]
    assert pq.ParquetFile(path).metadata.num_row_groups == report["row_groups"] >= 2
    check_rows(pq.read_table(path).to_pylist())
    dataset = load_dataset("parquet", data_files=str(path), split="train",
                           cache_dir=str(tmp_path / "hf-cache"))
    check_rows(list(dataset))
    pandas = pytest.importorskip("pandas")
    frame = pandas.read_parquet(path)
    assert frame.set_index("key").loc["b.jpg", "error_kind"] == "decode"


def test_a_fanned_out_runs_rows_name_the_partition_that_captioned_them(tmp_path):
    """Each partition of a fanned-out run names its parts and records `<run_id>-p<N>` (which
    partition captioned the item); the run's fold takes them all into the run's one file."""
    from vlm_caption.tasks.results.done_index import read_done_index
    from vlm_caption.tasks.results.layout import partition_parts_id

    output = out(tmp_path / "out")
    for index, key in enumerate(["a.jpg", "b.jpg"]):
        parts_id = partition_parts_id(RUN1, index)
        write_shard(output, FP, parts_id, index, [record(key, parts_id, f"caption {index}")], SOURCE)
    parts = parquet_view.parts_by_run(output, FP)
    assert list(parts) == [RUN1] and len(parts[RUN1]) == 2
    report = parquet_view.fold_run(output, FP, RUN1, parts[RUN1], read_done_index(output, FP))
    assert report["rows"] == 2 and report["complete"] and parquet_view.parts_by_run(output, FP) == {}
    rows = by_key(pq.read_table(Path(tmp_path / "out") / run_parquet_key(RUN1)).to_pylist())
    assert {key: (row["run_id"], row["source"]) for key, row in rows.items()} == {
        "a.jpg": (f"{RUN1}-p0", SOURCE), "b.jpg": (f"{RUN1}-p1", SOURCE)}


def test_extra_record_fields_become_string_columns(tmp_path, monkeypatch):
    """A field another feature adds to the record (e.g. `structured`) is a JSON string column."""
    from pydantic import create_model

    extended = ResultRecord
    if "structured" not in ResultRecord.model_fields:
        extended = create_model("Extended", __base__=ResultRecord, structured=(dict | None, None))
        monkeypatch.setattr(parquet, "ResultRecord", extended)
    output = str(tmp_path / "out")
    fields = {**record("a.jpg", RUN1).model_dump(), "structured": {"animal": "cat", "count": 2}}
    write_shard(out(output), FP, RUN1, 0, [extended(**fields)], SOURCE)
    report = export_parquet(out(output), out(output), ONE_FILE)
    rows = pq.read_table(report["path"]).to_pylist()
    assert json.loads(rows[0]["structured"]) == {"animal": "cat", "count": 2}


def test_a_part_cut_short_is_named_and_the_export_not_complete(tmp_path):
    """A part cut short (by hand: a run writes each part whole, atomically) is named under
    `skipped`, its rows left out and the export not complete; the rebuild of the view says so too
    and keeps the part where it is, for a look."""
    output = tmp_path / "out"
    write_shard(out(output), FP, RUN1, 0, [record("a.jpg", RUN1), record("b.jpg", RUN1)], SOURCE)
    write_shard(out(output), FP, RUN1, 1, [record("z.jpg", RUN1)], SOURCE)
    cut = output / part_key(FP, RUN1, 0)
    cut.write_bytes(cut.read_bytes()[:100])

    report = export_parquet(out(output), out(output), ONE_FILE)
    assert report["complete"] is False and list(report["skipped"]) == [str(cut)]
    assert [row["key"] for row in pq.read_table(report["path"]).to_pylist()] == ["z.jpg"]
    assert main(["export", str(output)]) == 1  # the CLI's rebuild of the view says so too
    assert [row["key"] for row in pq.read_table(output / run_parquet_key(RUN1)).to_pylist()] == ["z.jpg"]
    assert cut.exists()


def test_s3_export(s3_client, tmp_path):
    from datasets import load_dataset

    s3_client.create_bucket(Bucket="parquet-out")
    output = "s3://parquet-out/runs/"
    write_history(output)
    report = export_parquet(out(output), out(output), ONE_FILE)
    assert report["path"] == f"s3://parquet-out/runs/{ONE_FILE}" and report["complete"]
    body = s3_client.get_object(Bucket="parquet-out", Key=f"runs/{ONE_FILE}")["Body"].read()
    import pyarrow as pa

    check_rows(pq.read_table(pa.BufferReader(body)).to_pylist())
    export_parquet(out(output), open_storage("s3://parquet-out/elsewhere/"), "r.parquet")
    body = s3_client.get_object(Bucket="parquet-out", Key="elsewhere/r.parquet")["Body"].read()
    local = tmp_path / "r.parquet"
    local.write_bytes(body)
    check_rows(list(load_dataset("parquet", data_files=str(local), split="train", cache_dir=str(tmp_path / "hf"))))


def test_cli_export_to_a_path(tmp_path, capsys):
    output = str(tmp_path / "out")
    write_history(output)
    target = tmp_path / "elsewhere" / "results.parquet"
    assert main(["export", output, "--to", str(target)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["path"] == str(target) and printed["rows"] == 3
    check_rows(pq.read_table(target).to_pylist())
    assert not list((Path(output) / "parquet").glob("*.parquet"))  # the view is left as it is: parts, no file


def test_cli_export_of_a_missing_folder_is_a_clear_error(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing-here")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_export_failure_at_run_end_is_recorded_not_raised(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    write_shard(out(tmp_path), FP, RUN1, 0, [record("a.jpg", RUN1)], SOURCE)
    monkeypatch.setattr(parquet_view, "fold_run", broken)
    assert export_after_run.fn(out(tmp_path), str(tmp_path), FP, RUN1) == {
        "error": "OSError: disk full", "complete": False}
    assert parquet_view.parts_by_run(out(tmp_path), FP)[RUN1]  # the part stays in the view, for the next run


@pytest.mark.parametrize("fails", [False, True])
def test_run_end_exports_and_records_it_in_the_manifest(tmp_path, monkeypatch, fails):
    """The flow's closing steps (no engine: the shards are written here); a failed export is in
    the manifest and the summary, and the run still returns."""
    import vlm_caption.flows.caption as caption
    from vlm_caption.flows.params import CaptionJob
    from vlm_caption.flows.plan import RunPlan
    from vlm_caption.recipes import get_recipe
    from vlm_caption.tasks.observability import get_logger
    from vlm_caption.tasks.results.report import RunStats
    from vlm_caption.tasks.sources.formats import SourceSpec

    output = str(tmp_path / "out")
    (tmp_path / "src").mkdir()
    job = CaptionJob(source=str(tmp_path / "src"), output=output, recipe="llava", source_format="files")
    plan = RunPlan(job=job, recipe=get_recipe("llava"), model="tiny-llava", fingerprint=FP,
                   source=SourceSpec(job.source, "image", format="files"),
                   output=out(output))
    records = [record("a.jpg", RUN1), record("b.jpg", RUN1, None, {"kind": "decode", "message": "bad"})]

    def shards(run):
        stats = RunStats()
        stats.parts.append(write_shard(out(output), FP, RUN1, 0, records, job.source))  # as the pipeline names them
        stats.add(2, 0, records)
        return stats, None, None  # counts, engine, claims' figures

    def as_task(fn):  # a task's body, given its arguments as Prefect gives them (quoted ones unwrapped)
        from prefect.utilities.annotations import quote

        return lambda *args: fn(*(arg.unquote() if isinstance(arg, quote) else arg for arg in args))

    monkeypatch.setattr(caption, "caption_shards", shards)
    monkeypatch.setattr(caption, "write_manifest", as_task(write_manifest.fn))
    monkeypatch.setattr(caption, "export_after_run", as_task(export_after_run.fn))
    monkeypatch.setattr(caption, "publish_summary", lambda *args: None)
    monkeypatch.setattr(caption, "emit", lambda *args, **kwargs: None)
    if fails:
        monkeypatch.setattr(parquet_view, "fold_run", lambda *args, **kwargs: 1 / 0)
    summary = caption.caption_job(plan, RUN1, get_logger())
    manifest = json.loads((Path(output) / "manifests" / f"{RUN1}.json").read_text())
    assert manifest["counts"]["processed"] == 2 and summary["processed"] == 2
    if fails:
        assert summary["parquet"] is None and manifest["parquet"] == {"error": "ZeroDivisionError: division by zero",
                                                                      "complete": False}
        # The next run, with nothing new, folds the failed run's parts into the view.
        monkeypatch.undo()
        monkeypatch.setattr(caption, "caption_shards", lambda run: (RunStats(), None, None))
        for name in ("write_manifest", "export_after_run"):
            monkeypatch.setattr(caption, name, as_task(getattr(caption, name).fn))
        monkeypatch.setattr(caption, "publish_summary", lambda *args: None)
        monkeypatch.setattr(caption, "emit", lambda *args, **kwargs: None)
        caption.caption_job(plan, RUN2, get_logger())
        manifest = json.loads((Path(output) / "manifests" / f"{RUN2}.json").read_text())
        assert manifest["parquet"]["complete"] and manifest["parquet"]["repaired"][RUN1]["rows"] == 2
        assert sorted(pq.read_table(Path(output) / run_parquet_key(RUN1)).column("key").to_pylist()) == ["a.jpg",
                                                                                                          "b.jpg"]
    else:
        assert summary["parquet"] == manifest["parquet"]["path"] == str(Path(output) / run_parquet_key(RUN1))
        assert manifest["parquet"]["rows"] == 2 and manifest["parquet"]["complete"]
        assert pq.read_table(manifest["parquet"]["path"]).column("error_kind").to_pylist() == [None, "decode"]

        # The same job again with nothing new: no Parquet file written, no part read for the gallery.
        monkeypatch.setattr(caption, "caption_shards", lambda run: (RunStats(), None, None))
        summary = caption.caption_job(plan, RUN2, get_logger())
        manifest = json.loads((Path(output) / "manifests" / f"{RUN2}.json").read_text())
        assert manifest["parquet"]["path"] is None and manifest["parquet"]["rows"] == 0 and summary["parquet"] is None
        assert sorted(p.name for p in (Path(output) / "parquet").glob("**/*.parquet")) == [f"run-{RUN1}.parquet"]
        assert manifest["gallery"]["items"] == 0
