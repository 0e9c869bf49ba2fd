"""WebDataset tar shards as items: one item per sample (docs/sources.md, "WebDataset"). Damage stops
that tar with one item with a `problem`, never a silent gap; a store's failure is raised, and the
listing resumes after the items it handed over (`ShardStream`)."""

from __future__ import annotations

import contextlib
import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

from vlm_caption.tasks.sources.formats import SourceSpec, has_braces
from vlm_caption.tasks.sources.items import ObjectRef, RefusedRef, WorkItem
from vlm_caption.tasks.sources.reader import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, BadInput, ShardFilesReader
from vlm_caption.tasks.sources.storage import Storage, StorageError, open_seekable

TEXT_EXTENSIONS = ("txt", "text", "caption", "cls", "json")
METADATA_BYTES = 16 << 10  # a sample's kept text, at most; more is cut (listing memory stays small)
BLOCK = tarfile.BLOCKSIZE


@dataclass(frozen=True)
class TarMemberRef(ObjectRef):
    """One member of a tar shard: `key` names it (`<tar>/<member>`), `tar`, `offset`, `size` locate it."""

    tar: str = ""
    offset: int = 0


class WebDatasetReader(ShardFilesReader):
    """Tar shards: one tar, a prefix of tars, or a brace pattern (`shards/{00000..00099}.tar`)."""

    name = "webdataset"
    about = ("WebDataset tar shards: a tar, a prefix of tars or a brace pattern such as "
             "shards/{00000..00099}.tar (one item per sample)")
    suffixes = (".tar",)

    @classmethod
    def named_by(cls, location: str) -> bool:
        return super().named_by(location) or has_braces(location)

    @classmethod
    def detects(cls, names: list[str]) -> bool:
        return any(name.endswith(".tar") for name in names)  # img2dataset writes .parquet and .json beside its tars

    def check(self) -> SourceSpec:
        if next(self.shard_files(), None) is None:
            raise StorageError(f"{self.spec.where}: no .tar shard there; give a tar, a folder or prefix of "
                               "tars, or a brace pattern such as shards/{00000..00099}.tar")
        return self.spec

    def file_items(self, file: ObjectRef) -> Iterator[WorkItem]:
        return tar_items(self.storage, file, self.spec.modality)

    def read_member(self, member: ObjectRef) -> bytes:
        return read_member(self.storage, member)

    def locate(self, record_key: str, key: str, size: int, etag: str) -> ObjectRef | None:
        """The member a record names (its `members[0]`), located again: the inverse of `_item`'s."""
        tar, found, _ = key.partition(".tar/")
        offset = etag.rpartition("@")[2]
        if not found or not offset.isdigit():
            return None
        return TarMemberRef(key, size, etag, tar=tar + ".tar", offset=int(offset))


def split_member(name: str) -> tuple[str, str]:
    """`dir/000123.seg.jpg` -> (`dir/000123`, `seg.jpg`): webdataset's key, up to the name's first dot."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


@dataclass
class _Sample:
    key: str
    members: dict[str, tarfile.TarInfo]
    metadata: dict


def tar_items(storage: Storage, tar: ObjectRef, modality: str) -> Iterator[WorkItem]:
    """The samples of one tar, in order, then (if any) one item naming what is wrong with it."""
    if isinstance(tar, RefusedRef):  # a link out of the folder: one item saying so, never read
        yield _defect(tar, 0, tar.problem)
        return
    extensions = VIDEO_EXTENSIONS if modality == "video" else IMAGE_EXTENSIONS
    sample: _Sample | None = None
    with open_seekable(storage, tar.key, tar.size) as handle:
        try:
            archive = tarfile.open(fileobj=handle, mode="r:")
        except tarfile.TarError as exc:  # a store's failure is not a TarError: raised, not recorded
            yield _defect(tar, 0, f"{tar.key}: not a readable tar ({exc})")
            return
        while (info := _next(archive)) is not None:
            archive.members.clear()  # tarfile keeps every header; a shard may hold 100,000
            if not info.isfile():
                continue
            key, ext = split_member(info.name)
            if sample is not None and key != sample.key:
                yield _item(tar, sample, extensions)
                sample = None
            if info.offset_data + info.size > tar.size:
                problem = (f"{tar.key}: cut short: member {info.name} needs bytes up to "
                           f"{info.offset_data + info.size}, the tar has {tar.size}; upload the shard again")
                yield _defect(tar, info.offset_data, problem, f"{tar.key}/{key}")
                return
            sample = sample or _Sample(key, {}, {})
            sample.members.setdefault(ext, info)
            if ext.rpartition(".")[2] in TEXT_EXTENSIONS:  # by the last part, as webdataset decodes it
                sample.metadata[ext] = _text(handle, info)
        end = archive.offset
        handle.seek(end)
        problem = _end_problem(tar, end, handle.read(BLOCK))
    if sample is not None:
        yield _item(tar, sample, extensions)
    if problem is not None:
        yield _defect(tar, end, problem)


def _next(archive: tarfile.TarFile) -> tarfile.TarInfo | None:
    try:
        return archive.next()
    except tarfile.TarError:
        return None  # the end check below names the damage


def _end_problem(tar: ObjectRef, end: int, block: bytes) -> str | None:
    """tarfile stops quietly at a header it cannot parse or at the data's end: the block where
    it stopped says which. A whole tar ends with a zero block."""
    if len(block) == BLOCK and not block.strip(b"\0"):
        return None
    if len(block) < BLOCK:
        return (f"{tar.key}: cut short at byte {tar.size} (no end-of-archive block after byte {end}); "
                "samples after it are missing: upload the shard again")
    return f"{tar.key}: unreadable tar header at byte {end}; the rest of the shard is skipped"


def _text(handle, info: tarfile.TarInfo):
    """A text member, read through the listing's own file (tarfile seeks back to its next header)."""
    handle.seek(info.offset_data)
    data = handle.read(min(info.size, METADATA_BYTES))
    text = data.decode("utf-8", errors="replace")
    if info.size > METADATA_BYTES:
        return text + f"… (cut at {METADATA_BYTES} of {info.size} bytes)"
    if info.name.endswith(".json"):
        with contextlib.suppress(ValueError):
            return json.loads(text)
    return text


def _item(tar: ObjectRef, sample: _Sample, extensions: tuple[str, ...]) -> WorkItem:
    item_id = f"{tar.key}/{sample.key}"
    metadata = json.dumps(sample.metadata, ensure_ascii=False) if sample.metadata else None
    # A plain `jpg` first (a `seg.png` beside it is likely a mask), then a dotted one (`v2.final.jpg`).
    media = next((sample.members[ext] for ext in sample.members if ext in extensions),
                 next((sample.members[e] for e in sample.members if e.rpartition(".")[2] in extensions), None))
    if media is None:  # the item named by its first member, with what the sample has
        info, size = next(iter(sample.members.values())), 0
        problem = f"{item_id}: no {'/'.join(extensions[:3])}… member (has: {', '.join(sorted(sample.members))})"
    else:
        info, size, problem = media, media.size, None
    member = TarMemberRef(f"{tar.key}/{info.name}", size, f"{tar.etag}@{info.offset_data}", tar=tar.key,
                          offset=info.offset_data)
    return WorkItem(item_id, (member,), metadata=metadata, problem=problem)


def _defect(tar: ObjectRef, offset: int, problem: str, item_id: str | None = None) -> WorkItem:
    """An item standing for damage the listing found; its record is an error naming it."""
    return WorkItem(item_id or tar.key, (TarMemberRef(f"{tar.key}@{offset}", 0, f"{tar.etag}@{offset}",
                                                      tar=tar.key, offset=offset),), problem=problem)


def read_member(storage: Storage, ref: TarMemberRef) -> bytes:
    if ref.size <= 0:
        raise BadInput(f"{ref.key}: no media bytes")
    data = storage.read_range(ref.tar, ref.offset, ref.size)
    if len(data) != ref.size:  # retryable: the next run lists the tar as it is then
        raise OSError(f"{ref.key}: got {len(data)} of {ref.size} bytes: the tar changed or was cut short")
    return data
