"""Where a job's items come from, resolved: `SourceSpec` (its storage opened once, at the plan, and
carried), and the brace patterns shard lists are written with: `shards/{00000..00099}.tar`,
`{train,val}/{000..009}.tar` (zero padding kept, as bash and `braceexpand` do; `{0..10..2}` steps).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from vlm_caption.tasks.sources.storage import Storage, StorageError, open_storage

MAX_EXPANSION = 2_000_000  # names held as a set while listing; more is a mistake in the pattern

_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")


class BraceError(StorageError):
    """A brace pattern that cannot be expanded; the message says why."""


def has_braces(pattern: str) -> bool:
    return "{" in pattern and "}" in pattern


def _split(pattern: str) -> list[str | list[str]]:
    """Literal text and brace groups (each a list of alternatives, themselves patterns)."""
    parts: list[str | list[str]] = [""]
    depth = start = opened = 0
    for i, char in enumerate(pattern):
        if char == "{" and (depth := depth + 1) == 1:
            opened, start, alternatives = i, i + 1, []
        elif char == "," and depth == 1:
            alternatives.append(pattern[start:i])
            start = i + 1
        elif char == "}" and depth and (depth := depth - 1) == 0:
            alternatives.append(pattern[start:i])
            parts += [alternatives if len(alternatives) > 1 else _range(pattern, alternatives[0]), ""]
        elif depth == 0:
            parts[-1] += char
    if depth:
        raise BraceError(f"{pattern!r}: unbalanced '{{' at character {opened + 1}")
    return parts


def _range(pattern: str, body: str) -> list[str]:
    match = _RANGE.match(body)
    if not match:
        raise BraceError(f"{pattern!r}: {{{body}}} is neither a list {{a,b}} nor a range {{000..099}}")
    first, last, step = match.group(1), match.group(2), abs(int(match.group(3) or 1)) or 1
    width = len(first) if first.lstrip("-").startswith("0") and len(first) > 1 else 0
    lo, hi = int(first), int(last)
    values = range(lo, hi + 1, step) if lo <= hi else range(lo, hi - 1, -step)
    if len(values) > MAX_EXPANSION:
        raise BraceError(f"{pattern!r}: {{{body}}} names {len(values):,} shards, over {MAX_EXPANSION:,}")
    return [str(v).zfill(width) for v in values]


def expansion_count(pattern: str) -> int:
    """How many names the pattern stands for; BraceError for a broken or huge one."""
    total = 1
    for part in _split(pattern):
        if isinstance(part, list):
            total *= sum(expansion_count(alt) for alt in part)
    if total > MAX_EXPANSION:
        raise BraceError(f"{pattern!r} names {total:,} shards, over {MAX_EXPANSION:,}")
    return total


def expand_braces(pattern: str) -> Iterator[str]:
    """Every name the pattern stands for, in order (lazily)."""
    pieces = [[p] if isinstance(p, str) else list(itertools.chain.from_iterable(expand_braces(a) for a in p))
              for p in _split(pattern)]
    for combination in itertools.product(*pieces):
        yield "".join(combination)


@dataclass(frozen=True)
class ChangedSince:
    """Which items a listing keeps: modified after `after` (None: all), and the watermark's retries."""

    after: float | None  # epoch seconds
    watermark: str | None  # `auto`: the watermark file (its URI in the output)
    as_of: float  # epoch seconds: what the listing will have seen (its start, or the report's scan)


def source_storage(uri: str, follow_links: bool = False) -> Storage:
    """The storage of a source's folder or bucket prefix: the one place a source is opened."""
    return open_storage(uri, follow_links=follow_links)


def split_location(uri: str) -> tuple[str, str | None]:
    """`s3://b/shards/{000..009}.tar` -> (`s3://b/shards/`, `{000..009}.tar`); a single file
    likewise; a folder or prefix -> (itself, None)."""
    path = uri.rstrip("/")
    head = path.split("{", 1)[0]
    if has_braces(uri) or path.endswith((".tar", ".parquet")):
        scheme, _, rest = head.partition("://") if "://" in head else ("", "", head)
        if "/" not in rest:
            raise StorageError(f"{uri}: expected the shards inside a bucket or folder")
        cut = len(head) - len(rest) + rest.rfind("/") + 1
        return path[:cut], path[cut:]
    return uri, None


@dataclass(frozen=True)
class SourceSpec:
    """Where the items come from and how they are formed (`format` names its reader)."""

    uri: str  # a folder or bucket prefix, or a manifest file; for tars and Parquet, their folder
    modality: str = "image"
    glob: str | None = None
    format: str = "files"
    pattern: str | None = None  # tars or Parquet files under `uri`: one name or a brace pattern
    column: str | None = None  # parquet: the media column
    # Where the items' relative keys are when not under `uri`: a manifest's or path list's folder,
    # the bucket an inventory report lists (`uri` is then the report's manifest.json).
    items_root: str | None = None
    changed: ChangedSince | None = None  # --modified-since (tasks/sources/watermark.py)
    follow_links: bool = False  # the job's: read a folder's links that lead out of it
    opened: Storage | None = field(default=None, compare=False, repr=False)  # at `base`, opened once

    @property
    def storage(self) -> Storage:
        if self.opened is None:  # a manifest, path list or inventory report names its media, links or not
            follow = self.follow_links or self.items_root is not None
            object.__setattr__(self, "opened", source_storage(self.base, follow))
        return self.opened  # type: ignore[return-value]

    @property
    def base(self) -> str:
        """The folder or prefix the items' relative keys are under."""
        return self.items_root if self.items_root is not None else self.uri

    @property
    def where(self) -> str:
        """The location as the job names it: `uri` with its pattern."""
        return self.uri + (self.pattern or "")
