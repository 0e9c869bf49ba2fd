"""A folder or bucket prefix of media objects: one item per object (image, video), or with
`--modality multi-image` one per folder (`tasks/sources/groups.py`)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

from tasks.sources.fetch import MediaFetcher
from tasks.sources.items import ObjectRef, RefusedRef, WorkItem
from tasks.sources.reader import SourceReader


class FilesReader(SourceReader):
    """The objects under the source, listed page by page (the default format)."""

    name = "files"
    about = "media objects (one item per object, or per folder with multi-image)"
    groups = True
    timed = True

    @functools.cached_property
    def fetcher(self) -> MediaFetcher:
        return MediaFetcher(self.storage, keys_only=True)  # listed keys, never locations

    def check(self):
        next(iter(self.storage.iter_objects()), None)  # one page is enough to prove access
        return self.spec

    def objects(self) -> Iterator[ObjectRef]:
        """The listed objects (the job's glob applied), in listing order."""
        return self.storage.iter_objects(self.spec.glob)

    def items(self) -> Iterator[WorkItem]:
        for ref in self.objects():  # a link the storage refuses is its item's `bad_input` record
            yield WorkItem(ref.key, (ref,), problem=ref.problem if isinstance(ref, RefusedRef) else None)

    def read_member(self, member: ObjectRef) -> bytes:
        return self.fetcher.read(member)
