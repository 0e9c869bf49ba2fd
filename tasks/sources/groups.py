"""Multi-image groups from a listing: the objects directly under one folder, in key order."""

from __future__ import annotations

from collections.abc import Iterator

from vlm_caption.tasks.sources.files import FilesReader
from vlm_caption.tasks.sources.items import ObjectRef, RefusedRef, WorkItem
from vlm_caption.tasks.sources.reader import SourceReader

ROOT_GROUP = "."  # objects at the source root, beside the folders


class GroupsReader(SourceReader):
    """One item per folder of a listing of objects (a folder or bucket, an inventory report):
    what `--modality multi-image` makes of a reader that lists objects."""

    name = "groups"
    groups = True
    selectable = False

    def __init__(self, objects: FilesReader):
        super().__init__(objects.spec)
        self.objects = objects

    def check(self):
        return self.objects.check()

    def items(self) -> Iterator[WorkItem]:
        """One item per folder. A folder's objects need not be contiguous in a listing (S3 sorts
        `a/b/x.jpg` between `a/a.jpg` and `a/c.jpg`), so the whole listing is grouped first."""
        groups: dict[str, list[ObjectRef]] = {}
        for ref in self.objects.objects():
            folder = ref.key.rsplit("/", 1)[0] if "/" in ref.key else ROOT_GROUP
            groups.setdefault(folder, []).append(ref)
        for folder, members in sorted(groups.items()):  # a group with a refused link is refused whole
            yield WorkItem(folder, tuple(sorted(members, key=lambda m: m.key)),
                           problem=next((m.problem for m in members if isinstance(m, RefusedRef)), None))

    def read_member(self, member: ObjectRef) -> bytes:
        return self.objects.read_member(member)
