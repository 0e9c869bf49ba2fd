"""Every source format by name (`--source-format`; `auto` tries them in order), reached only
through its reader (`tasks/sources/reader.py`). A new format: its `SourceReader` and a line here."""

from __future__ import annotations

import itertools

from vlm_caption.tasks.sources import formats
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.inventory import InventoryReader
from vlm_caption.tasks.sources.manifest import ManifestReader
from vlm_caption.tasks.sources.parquet_source import ParquetReader
from vlm_caption.tasks.sources.path_list import PathListReader
from vlm_caption.tasks.sources.reader import FIRST_PAGE, FilesReader, SourceReader
from vlm_caption.tasks.sources.storage import StorageError
from vlm_caption.tasks.sources.s3_client import retry_transient
from vlm_caption.tasks.sources.webdataset import WebDatasetReader

# `auto` asks each in turn (a prefix holding tars is WebDataset even with Parquet beside them);
# `files` (which claims nothing) is what is left.
READERS: dict[str, type[SourceReader]] = {reader.name: reader for reader in (
    FilesReader, WebDatasetReader, ParquetReader, InventoryReader, PathListReader, ManifestReader)}
SOURCE_FORMATS = ("auto", *(name for name, reader in READERS.items() if reader.selectable))


def formats_help() -> str:
    """What each format reads, and how `auto` picks one (the job's field and the CLI option)."""
    named = "/".join(suffix for reader in READERS.values() for suffix in reader.suffixes)
    return ("; ".join(f"`{name}`: {READERS[name].about}" for name in SOURCE_FORMATS[1:])
            + f". `auto`: from {named} or braces in the location, else from the objects listed first.")


def reader_class(name: str) -> type[SourceReader]:
    try:
        return READERS[name]
    except KeyError:
        raise StorageError(f"unknown source format {name!r}; the formats are: {', '.join(SOURCE_FORMATS)}") from None


def open_reader(spec: SourceSpec) -> SourceReader:
    return reader_class(spec.format)(spec)


def detect_format(uri: str, requested: str, is_manifest: bool) -> str:
    """`requested` unless `auto`: then from the location, or its first listed page (one that cannot
    be listed raises: a guess of `files` would caption a prefix of tars as images, for good)."""
    if is_manifest:
        return ManifestReader.name
    if requested != "auto":
        return requested
    named = next((name for name, reader in READERS.items() if reader.named_by(uri)), None)
    if named is not None:
        return named
    names = retry_transient(lambda: [ref.key for ref in itertools.islice(formats.source_storage(uri).iter_objects(),
                                                                        FIRST_PAGE)], f"{uri}: first page")
    return next((name for name, reader in READERS.items() if reader.detects(names)), FilesReader.name)
