"""A folder or bucket prefix of media objects: one item per object (image, video), or with
`--modality multi-image` one per folder (`tasks/sources/groups.py`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from vlm_caption.tasks.sources.storage import StorageError
from vlm_caption.tasks.sources.webdataset import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from vlm_caption.tasks.sources.items import ObjectRef, RefusedRef, WorkItem
from vlm_caption.tasks.sources.reader import SourceReader


MODALITY_PAGE = 1000  # objects the check reads for what the source holds (one S3 page)


def _kind(key: str) -> str | None:
    """"image" or "video" by a key's extension; None for anything else (text, metadata)."""
    ext = key.rsplit(".", 1)[-1].lower() if "." in key.rsplit("/", 1)[-1] else ""
    return "image" if ext in IMAGE_EXTENSIONS else "video" if ext in VIDEO_EXTENSIONS else None


class FilesReader(SourceReader):
    """The objects under the source, listed page by page (the default format)."""

    name = "files"
    about = "media objects (one item per object, or per folder with multi-image)"
    groups = True
    timed = True
    keys_only = True  # listed keys, never locations

    def check(self):
        """One page proves access, and tells a small source of images asked for videos (or the
        other way round), which would otherwise be an error record per item. (A larger one is not
        judged on its first page: thumbnails may sort before their videos.)"""
        page = list(itertools.islice(self.storage.iter_objects(self.spec.glob), MODALITY_PAGE))
        kinds = {_kind(ref.key) for ref in page} - {None}
        wanted = "video" if self.spec.modality == "video" else "image"
        if len(page) < MODALITY_PAGE and kinds and wanted not in kinds:
            found = next(ref.key for ref in page if _kind(ref.key))
            raise StorageError(
                f"{self.spec.where}: holds {kinds.pop()}s ({found}, ...), not {wanted}s: use --modality "
                f"{'video' if wanted == 'image' else 'image'}, or a source of {wanted}s")
        return self.spec

    def objects(self) -> Iterator[ObjectRef]:
        """The listed objects (the job's glob applied), in listing order."""
        return self.storage.iter_objects(self.spec.glob)

    def items(self) -> Iterator[WorkItem]:
        for ref in self.objects():  # a link the storage refuses is its item's `bad_input` record
            yield WorkItem(ref.key, (ref,), problem=ref.problem if isinstance(ref, RefusedRef) else None)
