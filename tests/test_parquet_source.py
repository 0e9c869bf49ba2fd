"""Parquet sources: files made by pyarrow with a column of image bytes or of s3:// URIs, read in
row groups; the other columns kept in the record; a wrong column is one message naming the
columns there are, before any engine starts (exit 2 from the CLI); end to end through the flow
from a folder with the tiny checkpoint, and a rerun recomputes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlm_caption.tasks.sources.parquet_source import ColumnError, ParquetReader, read_cell
from vlm_caption.tasks.sources.registry import detect_format
from vlm_caption.tasks.sources.storage import open_storage
from tests.images import corrupt_jpeg, image_bytes
from tests.result_files import records as result_records

BUCKET = "parquet-src"


def write_parquet(path, rows: int, *, corrupt: int | None = None, empty: int | None = None,
                  url_prefix: str | None = None, row_group_size: int = 4) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = [None if i == empty else corrupt_jpeg() if i == corrupt
              else image_bytes("PNG", size=(70 + i, 50), color=(i * 30 % 256, 60, 120)) for i in range(rows)]
    columns = {"caption": [f"alt {i}" for i in range(rows)], "width": list(range(rows))}
    if url_prefix is None:
        columns["image"] = pa.array(images, pa.binary())
    else:
        columns["url"] = [f"{url_prefix}{i}.png" for i in range(rows)]
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


def reader(location: str, column: str | None = None) -> ParquetReader:
    return ParquetReader(ParquetReader.spec_for(location, column=column))


def test_rows_from_row_groups_with_metadata_and_column_errors(tmp_path: Path):
    write_parquet(tmp_path / "a.parquet", 10, empty=5)
    assert detect_format(str(tmp_path), "auto", False) == "parquet"
    assert reader(str(tmp_path)).check().column == "image"  # the usual name, found
    items = list(reader(str(tmp_path), "image").items())
    assert [i.id for i in items] == [f"a.parquet/{i}" for i in range(10)]
    assert json.loads(items[7].metadata) == {"caption": "alt 7", "width": 7}
    assert items[5].problem and "empty" in items[5].problem
    cell = items[6].members[0]
    assert (cell.row_group, cell.row, cell.size) == (1, 2, len(image_bytes("PNG", size=(76, 50), color=(180, 60, 120))))
    assert read_cell(open_storage(str(tmp_path)), cell) == image_bytes("PNG", size=(76, 50), color=(180, 60, 120))

    with pytest.raises(ColumnError) as wrong:
        reader(str(tmp_path), "img").check()
    assert "no column 'img'; the columns are: caption, width, image" in str(wrong.value)
    write_parquet(tmp_path / "u.parquet", 2, url_prefix="s3://b/x/")
    (tmp_path / "a.parquet").unlink()
    assert reader(str(tmp_path)).check().column == "url"
    assert [m.members[0].key for m in reader(str(tmp_path / "u.parquet"), "url").items()] \
        == ["s3://b/x/0.png", "s3://b/x/1.png"]


def test_wrong_column_in_a_bucket_is_exit_2_before_any_engine(prefect_api, s3_client, tiny_llava, capsys):
    import io

    from vlm_caption.flows.cli import main

    s3_client.create_bucket(Bucket=BUCKET)
    body = io.BytesIO()
    write_parquet(body, 3)
    s3_client.put_object(Bucket=BUCKET, Key="t/rows.parquet", Body=body.getvalue())
    code = main(["run", f"s3://{BUCKET}/t/rows.parquet", "--column", "picture", "--out", f"s3://{BUCKET}/o/",
                 "--model", str(tiny_llava)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "no column 'picture'; the columns are: caption, width, image" in err
    assert "Traceback" not in err


def test_folder_of_parquet_end_to_end_and_rerun(prefect_api, tiny_llava, tmp_path: Path):
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob

    source = tmp_path / "rows"
    source.mkdir()
    write_parquet(source / "part-0.parquet", 6, corrupt=2, empty=4)
    write_parquet(source / "part-1.parquet", 3)
    job = CaptionJob(source=str(source), output=str(tmp_path / "out"), model=str(tiny_llava), shard_size=4,
                     sampling={"max_tokens": 4}, column="image", gallery_items=20)
    summary = vlm_caption(job)
    records = result_records(tmp_path / "out")
    by_key = {r["key"]: r for r in records}
    assert sorted(by_key) == sorted([f"part-0.parquet/{i}" for i in range(6)] + [f"part-1.parquet/{i}" for i in range(3)])
    assert by_key["part-0.parquet/2"]["error"]["kind"] == "decode"
    assert by_key["part-0.parquet/4"]["error"]["kind"] == "bad_input"
    good = [r for r in records if r["error"] is None]
    assert len(good) == 7 and all(r["text"] is not None and r["sha256"] for r in good)
    assert by_key["part-1.parquet/1"]["metadata"] == {"caption": "alt 1", "width": 1}
    manifest = json.loads((tmp_path / "out" / "manifests" / f"{summary['run_id']}.json").read_text())
    assert manifest["parameters"]["source_format"] == "parquet" and manifest["parameters"]["column"] == "image"
    assert (tmp_path / "out" / "manifests" / f"{summary['run_id']}.html").exists()

    again = vlm_caption(job)
    assert again["processed"] == 0 and again["skipped_already_done"] == 9
    again_records = result_records(tmp_path / "out")
    assert len(again_records) == len(records)  # nothing computed again
