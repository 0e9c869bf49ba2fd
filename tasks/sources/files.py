"""A folder or bucket prefix of media objects: one item per object (image, video), or with
`--modality multi-image` one per folder: the objects directly under it, in key order."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from vlm_caption.tasks.sources.storage import StorageError
from vlm_caption.tasks.sources.webdataset import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from vlm_caption.tasks.sources.items import ObjectRef, RefusedRef, WorkItem
from vlm_caption.tasks.sources.reader import SourceReader


MODALITY_PAGE = 1000  # objects the check reads for what the source holds (one S3 page)
ROOT_GROUP = "."  # a group's name for the objects at the source root, beside the folders


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
        """One page proves access, and tells a small source of images asked for videos (or the other
        way round); a larger one is not judged on it (thumbnails may sort before their videos)."""
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
        return self.storage.iter_objects(self.spec.glob)

    def items(self) -> Iterator[WorkItem]:
        """One item per object, or for multi-image per folder: the whole listing grouped first, a
        folder's objects not being contiguous (S3 sorts `a/b/x.jpg` between `a/a.jpg` and `a/c.jpg`)."""
        if self.spec.modality != "multi-image":
            for ref in self.objects():
                yield WorkItem(ref.key, (ref,), problem=ref.problem if isinstance(ref, RefusedRef) else None)
            return
        groups: dict[str, list[ObjectRef]] = {}
        for ref in self.objects():
            groups.setdefault(ref.key.rsplit("/", 1)[0] if "/" in ref.key else ROOT_GROUP, []).append(ref)
        for folder, members in sorted(groups.items()):  # a group with a refused link is refused whole
            yield WorkItem(folder, tuple(sorted(members, key=lambda m: m.key)),
                           problem=next((m.problem for m in members if isinstance(m, RefusedRef)), None))
