"""A path list (`--source-format paths`): a text file naming one medium per line, each one item
(docs/sources.md, "Path lists"); the example of a new format: this reader and its registry entry."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlparse

from vlm_caption.tasks.sources.items import ObjectRef, WorkItem
from vlm_caption.tasks.sources.manifest import ManifestReader
from vlm_caption.tasks.sources.storage import StorageError, matches_glob

FETCHED_SCHEMES = ("", "s3", "s3a", "http", "https", "file")  # what SourceReader.read_member reads
UNFETCHABLE = "unfetchable"


class PathListReader(ManifestReader):
    name = "paths"
    about = "a text file of paths and URLs (one item per line)"
    suffixes = (".txt",)
    groups = False
    selectable = True
    checking = "reading the path list"
    kind = "path list"

    def items(self) -> Iterator[WorkItem]:
        try:
            text = self.text()
        except UnicodeDecodeError as exc:
            raise StorageError(f"{self.spec.uri}: not a UTF-8 text file ({exc})") from exc
        seen: set[str] = set()
        for line in text.splitlines():
            path = line.strip()
            if not path or path.startswith("#") or path in seen or not matches_glob(path, self.spec.glob):
                continue
            seen.add(path)
            scheme = urlparse(path).scheme
            if scheme in FETCHED_SCHEMES or len(scheme) == 1:  # a Windows drive is no scheme
                yield WorkItem(path, (ObjectRef(path),))
                continue
            # Listed with an etag of its own, so that a rerun finds its bad_input record done.
            yield WorkItem(path, (ObjectRef(path, 0, UNFETCHABLE),), problem=(
                f"{path}: a {scheme}:// location; a path list names s3:// URIs, http(s) URLs or paths"))
