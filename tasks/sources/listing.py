"""List the source and cut it into shards of work items, never loading object bytes.

A folder or bucket gives one item per object (image, video) or per folder (multi-image groups);
a job manifest gives one item per line.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prefect import task
from prefect.cache_policies import NONE

from tasks.observability import get_logger
from tasks.sources.groups import folder_groups
from tasks.sources.items import Shard, WorkItem, partition_of
from tasks.sources.manifest import read_manifest
from tasks.sources.storage import open_storage


@dataclass(frozen=True)
class SourceSpec:
    """Where the items come from and how they are formed."""

    uri: str  # a folder or bucket prefix, or a manifest file
    modality: str = "image"
    is_manifest: bool = False
    glob: str | None = None


def iter_items(source: SourceSpec) -> Iterator[WorkItem]:
    if source.is_manifest:
        yield from read_manifest(source.uri)
        return
    objects = open_storage(source.uri).iter_objects(source.glob)
    if source.modality == "multi-image":
        yield from folder_groups(objects)
        return
    for ref in objects:
        yield WorkItem(ref.key, (ref,))


def iter_shards(items: Iterable[WorkItem], shard_size: int) -> Iterator[Shard]:
    """Group a (lazy) sequence of items into shards of `shard_size`."""
    batch: list[WorkItem] = []
    index = 0
    for item in items:
        batch.append(item)
        if len(batch) == shard_size:
            yield Shard(index, tuple(batch))
            index, batch = index + 1, []
    if batch:
        yield Shard(index, tuple(batch))


def in_partition(items: Iterable[WorkItem], limit: int | None,
                 partition: tuple[int, int] | None) -> Iterator[WorkItem]:
    """The first `limit` items (the whole job's limit), then only this partition's."""
    for count, item in enumerate(items, start=1):
        if limit is not None and count > limit:
            return
        if partition is None or partition_of(item.id, partition[1]) == partition[0]:
            yield item


@task(name="list-source", cache_policy=NONE, persist_result=False, retries=2, retry_delay_seconds=5)
def list_source(source: SourceSpec, shard_size: int, limit: int | None,
                partition: tuple[int, int] | None = None) -> list[Shard]:
    """Page through the source and cut it into shards.

    `partition=(index, count)` keeps the items whose id hashes to `index`: the runs of a
    fan-out list the same source and each takes a disjoint slice, so nothing is done twice."""
    shards = list(iter_shards(in_partition(iter_items(source), limit, partition), shard_size))
    get_logger(source=source.uri).info(
        "listed source", items=sum(len(s.items) for s in shards), shards=len(shards),
        partition=f"{partition[0]}/{partition[1]}" if partition else None,
    )
    return shards
