"""Multi-image groups from a listing: the objects directly under one folder, in key order."""

from __future__ import annotations

from collections.abc import Iterable

from tasks.sources.items import ObjectRef, WorkItem

ROOT_GROUP = "."  # objects at the source root, beside the folders


def folder_groups(refs: Iterable[ObjectRef]) -> list[WorkItem]:
    """One item per folder. A folder's objects need not be contiguous in a listing (S3 sorts
    `a/b/x.jpg` between `a/a.jpg` and `a/c.jpg`), so the whole listing is grouped first."""
    groups: dict[str, list[ObjectRef]] = {}
    for ref in refs:
        folder = ref.key.rsplit("/", 1)[0] if "/" in ref.key else ROOT_GROUP
        groups.setdefault(folder, []).append(ref)
    return [WorkItem(folder, tuple(sorted(members, key=lambda m: m.key)))
            for folder, members in sorted(groups.items())]
