"""A path list (`--source-format paths`): a text file naming one medium per line, as `find`,
`aws s3 ls` piped through `awk`, or a dataset's file list give them.

    s3://media/a.jpg
    https://example.org/b.jpg
    clips/c.mp4          # a key relative to the list's own folder
    /data/d.png

Each line is one item (image or video), its id the line itself. Blank lines, lines starting
with `#` and lines the job's glob leaves out are skipped, as is a line naming what an earlier line named (ids name results). A line
that names nothing the run can fetch (another scheme) is a final `bad_input` record naming it.

This module is also the example of what a new source format takes: a `SourceReader` here and
its entry in `tasks/sources/registry.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from urllib.parse import urlparse

from vlm_caption.tasks.sources.fetch import MediaFetcher
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.items import ObjectRef, WorkItem
from vlm_caption.tasks.sources.reader import SourceReader
from vlm_caption.tasks.sources.storage import StorageError, matches_glob, split_parent

FETCHED_SCHEMES = ("", "s3", "s3a", "http", "https", "file")  # what MediaFetcher reads
UNFETCHABLE = "unfetchable"


class PathListReader(SourceReader):
    name = "paths"
    about = "a text file of paths and URLs (one item per line)"
    suffixes = (".txt",)
    checking = "reading the path list"

    @classmethod
    def spec_for(cls, location: str, *, modality: str = "image", glob: str | None = None,
                 column: str | None = None) -> SourceSpec:
        return SourceSpec(location, modality, glob=glob, format=cls.name, items_root=split_parent(location)[0])

    @property
    def file_name(self) -> str:
        return split_parent(self.spec.uri)[1]

    @functools.cached_property
    def fetcher(self) -> MediaFetcher:
        return MediaFetcher(self.storage)

    def check(self) -> SourceSpec:
        if not self.storage.exists(self.file_name):
            raise StorageError(f"{self.spec.uri}: path list not found")
        return self.spec

    def items(self) -> Iterator[WorkItem]:
        try:
            text = self.storage.read(self.file_name).decode("utf-8")
        except FileNotFoundError as exc:
            raise StorageError(f"{self.spec.uri}: path list not found") from exc
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

    def read_member(self, member: ObjectRef) -> bytes:
        return self.fetcher.read(member)
