"""The records an output holds, read as a user would: every Parquet file under `<output>/parquet/`
(the view's files and the parts of runs not folded into it yet), each row as the record it was
made from (`record_from_row`), as JSON-ready dicts with the record's field names."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from vlm_caption.tasks.results.done_rows import ROW, record_row
from vlm_caption.tasks.results.parquet import record_from_row


def _rows_as_records(data) -> list[dict]:
    return [record_from_row(row).model_dump(mode="json") for row in pq.read_table(data).to_pylist()]


def index_rows(records) -> np.ndarray:
    """The done-index rows of the records that are final, as a load reads them from their rows."""
    return np.array([record_row(r) for r in records if r.is_final], dtype=ROW)


def parquet_files(output: str | Path) -> list[Path]:
    """The output's Parquet files: the view's, then the parts of runs not folded yet, by name."""
    root = Path(output) / "parquet"
    return sorted(root.glob("*.parquet")) + sorted(root.glob("*/part-*.parquet"))


def records(output: str | Path) -> list[dict]:
    """Every record of a folder output (the view, and the parts of runs not folded into it)."""
    return [record for path in parquet_files(output) for record in _rows_as_records(path)]


def part_records(output: str | Path) -> list[dict]:
    """The records of the parts not folded into the view yet (a killed run's, a running one's)."""
    return [record for path in sorted((Path(output) / "parquet").glob("*/part-*.parquet"))
            for record in _rows_as_records(path)]


def s3_keys(s3_client, bucket: str, prefix: str) -> list[str]:
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def s3_records(s3_client, bucket: str, out_prefix: str, keys: list[str] | None = None) -> list[dict]:
    """Every record of an S3 output `s3://bucket/out_prefix` (its `parquet/` files), or of the files `keys`."""
    if keys is None:
        keys = [key for key in s3_keys(s3_client, bucket, f"{out_prefix}parquet/") if key.endswith(".parquet")]
    return [record for key in keys for record in _rows_as_records(
        io.BytesIO(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()))]
