"""Parquet files as items: one item (`<file>/<row>`) per row, its media in `column`, the other
columns the record's metadata (docs/sources.md, "Parquet")."""

from __future__ import annotations

import base64
import dataclasses
import datetime
import functools
import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.items import ObjectRef, WorkItem
from vlm_caption.tasks.sources.reader import BadInput, ShardFilesReader
from vlm_caption.tasks.sources.storage import Storage, StorageError, open_seekable
from vlm_caption.tasks.sources.s3_client import is_transient, retry_transient

DEFAULT_COLUMNS = ("image", "jpg", "png", "webp", "url", "URL", "uri", "path")  # tried when no column is given
BATCH_ROWS = 256
METADATA_BYTES = 16 << 10


@dataclass(frozen=True)
class ParquetCellRef(ObjectRef):
    """A bytes cell: `key` names it (`<file>/<row>`), the fields locate it."""

    file: str = ""
    row_group: int = 0
    row: int = 0  # within the row group
    column: str = ""
    file_size: int = -1


class ColumnError(StorageError):
    """The media column is not in the file (a pre-flight error: exit 2 from the CLI)."""


class ParquetReader(ShardFilesReader):
    """Parquet files (one, a prefix of them, or a brace pattern): one item per row."""

    name = "parquet"
    about = "Parquet files (one item per row, its media in `column`)"
    suffixes = (".parquet",)
    takes_column = True

    @classmethod
    def detects(cls, names: list[str]) -> bool:
        return bool(names) and all(name.endswith(".parquet") for name in names)

    def check(self) -> SourceSpec:
        """The media column named (or a usual name) in the first file's schema, from its footer."""
        first = next(self.shard_files(), None)
        if first is None:
            raise StorageError(f"{self.spec.where}: no .parquet file there")
        where = self.storage.describe(first.key)
        try:
            schema = retry_transient(lambda: _parquet_file(self.storage, first).schema_arrow, where)
        except Exception as exc:  # noqa: BLE001 - said as what it is; a store's failure is pre-flight's to explain
            if is_transient(exc):
                raise
            raise StorageError(f"{where}: not a readable Parquet file ({exc})") from exc
        return dataclasses.replace(self.spec, column=choose_column(schema.names, self.spec.column, where))

    def file_items(self, file: ObjectRef) -> Iterator[WorkItem]:
        return parquet_items(self.storage, file, self.spec.column)

    def read_member(self, member: ObjectRef) -> bytes:
        if isinstance(member, ParquetCellRef):
            return read_cell(self.storage, member)
        return super().read_member(member)  # a URL, s3:// URI or path cell

    def locate(self, record_key: str, key: str, size: int, etag: str) -> ObjectRef | None:
        """A bytes cell (`<file>/<row>`) is located again from its file's footer."""
        if key != record_key:  # a URL cell's member is named by its URL
            return ObjectRef(key, size, etag)
        file, _, row = key.rpartition("/")
        if not row.isdigit() or not self.spec.column:
            return None
        file_size, group_rows = _layout(self.storage, file, etag.rpartition(":")[0])  # by the file's etag: a new read
        start, wanted = 0, int(row)
        for group, rows in enumerate(group_rows):
            if wanted < start + rows:
                return ParquetCellRef(key, size, etag, file=file, row_group=group, row=wanted - start,
                                      column=self.spec.column, file_size=file_size)
            start += rows
        return None


def _parquet_file(storage: Storage, ref: ObjectRef):
    import pyarrow.parquet as pq

    return pq.ParquetFile(open_seekable(storage, ref.key, ref.size))


def choose_column(names: list[str], column: str | None, where: str) -> str:
    """The media column: the one asked for, or the first usual name present."""
    if column is not None:
        if column not in names:
            raise ColumnError(f"{where}: no column {column!r}; the columns are: {', '.join(names)}. "
                              "Name the one with the images' URLs, paths or bytes with --column.")
        return column
    found = next((name for name in DEFAULT_COLUMNS if name in names), None)
    if found is None:
        raise ColumnError(f"{where}: which column holds the media? The columns are: {', '.join(names)}. "
                          "Name it with --column (URLs, s3:// URIs, paths or image bytes).")
    return found


def parquet_items(storage: Storage, ref: ObjectRef, column: str | None) -> Iterator[WorkItem]:
    """One item per row; a file that is not Parquet or lacks the column is one item naming the
    problem (a final `bad_input` record). A store's transient failure is raised, never recorded:
    the listing resumes after the items it handed over (`ShardStream`)."""
    import pyarrow as pa

    try:
        parquet = retry_transient(lambda: _parquet_file(storage, ref), storage.describe(ref.key))
        name = choose_column(parquet.schema_arrow.names, column, storage.describe(ref.key))
    except Exception as exc:  # noqa: BLE001 - this file's problem, not the run's, unless the store's
        if is_transient(exc):
            raise
        yield WorkItem(ref.key, (ParquetCellRef(f"{ref.key}/-", 0, f"{ref.etag}:-", file=ref.key),),
                       problem=str(exc) if isinstance(exc, StorageError) else f"{ref.key}: unreadable ({exc})")
        return
    kind = parquet.schema_arrow.field(name).type
    binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    row_index = 0
    for group in range(parquet.num_row_groups):
        batches = parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=[group])
        for in_group, row in enumerate(row for batch in batches for row in batch.to_pylist()):
            yield _row_item(ref, row, name, binary, group, in_group, row_index)
            row_index += 1


def _row_item(ref: ObjectRef, row: dict, name: str, binary: bool, group: int, in_group: int,
              row_index: int) -> WorkItem:
    item_id = f"{ref.key}/{row_index}"
    cell = row.pop(name)
    metadata = _metadata(row)
    if binary:
        member = ParquetCellRef(item_id, len(cell or b""), f"{ref.etag}:{row_index}", file=ref.key,
                                row_group=group, row=in_group, column=name, file_size=ref.size)
        problem = None if cell else f"{item_id}: column {name!r} is empty in this row"
        return WorkItem(item_id, (member,), metadata=metadata, problem=problem)
    if not cell or not isinstance(cell, str):
        return WorkItem(item_id, (ParquetCellRef(item_id, 0, f"{ref.etag}:{row_index}", file=ref.key),),
                        metadata=metadata, problem=f"{item_id}: column {name!r} holds no URL or path in this row")
    return WorkItem(item_id, (ObjectRef(cell),), metadata=metadata)


def _jsonable(value):
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>" if len(value) > 64 else base64.b64encode(value).decode()
    if isinstance(value, (datetime.date, datetime.datetime, datetime.time)):
        return value.isoformat()
    return str(value)


def _metadata(row: dict) -> str | None:
    if not row:
        return None
    text = json.dumps(row, ensure_ascii=False, default=_jsonable)
    if len(text) > METADATA_BYTES:
        return json.dumps({"cut": f"the row's other columns are {len(text)} bytes as JSON, over {METADATA_BYTES}"})
    return text


_LOADED: dict[tuple, Future] = {}  # the media columns of the few row groups being fetched from
_LOADED_LOCK = threading.Lock()
ROW_GROUPS_KEPT = 4


def _row_group_column(storage: Storage, ref: ParquetCellRef) -> list:
    """A row group's media column, read once for every fetch thread that waits on it."""
    key = (storage.uri, ref.file, ref.etag.rsplit(":", 1)[0], ref.row_group, ref.column)
    with _LOADED_LOCK:
        loaded = _LOADED.get(key)
        owner = loaded is None
        if owner:
            loaded = _LOADED[key] = Future()
            while len(_LOADED) > ROW_GROUPS_KEPT:
                _LOADED.pop(next(iter(_LOADED)))
    if owner:
        try:
            table = _parquet_file(storage, ObjectRef(ref.file, ref.file_size)).read_row_group(
                ref.row_group, columns=[ref.column])
            loaded.set_result(table.column(0).to_pylist())
        except Exception as exc:  # noqa: BLE001 - every waiting fetch gets it
            loaded.set_exception(exc)
            with _LOADED_LOCK:
                _LOADED.pop(key, None)
    return loaded.result()


def read_cell(storage: Storage, ref: ParquetCellRef) -> bytes:
    """A bytes cell's value (its row group's column read once for the shards near it)."""
    value = _row_group_column(storage, ref)[ref.row]
    if not value:
        raise BadInput(f"{ref.key}: the cell is empty")
    return bytes(value)


@functools.lru_cache(maxsize=64)
def _layout(storage: Storage, file: str, file_etag: str) -> tuple[int, tuple[int, ...]]:
    """A file's size and its row groups' row counts (read once per file, not per cell)."""
    folder = file.rpartition("/")[0]
    listed = next((r for r in storage.iter_objects(prefix=f"{folder}/" if folder else "") if r.key == file), None)
    if listed is None:
        raise FileNotFoundError(f"{storage.describe(file)}: no such object")
    metadata = _parquet_file(storage, listed).metadata
    return listed.size, tuple(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))
