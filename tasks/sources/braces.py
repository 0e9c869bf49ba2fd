"""Brace patterns as img2dataset and webdataset users write shard lists:
`shards/{00000..00099}.tar`, `{train,val}/{000..009}.tar` (ranges keep their zero padding,
as bash and `braceexpand` do; `{0..10..2}` steps)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

from vlm_caption.tasks.sources.storage import StorageError

MAX_EXPANSION = 2_000_000  # names held as a set while listing; more is a mistake in the pattern

_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")


class BraceError(StorageError):
    """A brace pattern that cannot be expanded; the message says why."""


def has_braces(pattern: str) -> bool:
    return "{" in pattern and "}" in pattern


def _split(pattern: str) -> list[str | list[str]]:
    """Literal text and brace groups (each a list of alternatives, themselves patterns)."""
    parts: list[str | list[str]] = []
    literal, i = "", 0
    while i < len(pattern):
        if pattern[i] != "{":
            literal += pattern[i]
            i += 1
            continue
        depth, j, alternatives, start = 0, i, [], i + 1
        while j < len(pattern):
            if pattern[j] == "{":
                depth += 1
            elif pattern[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            elif pattern[j] == "," and depth == 1:
                alternatives.append(pattern[start:j])
                start = j + 1
            j += 1
        if depth != 0:
            raise BraceError(f"{pattern!r}: unbalanced '{{' at character {i + 1}")
        alternatives.append(pattern[start:j])
        parts.append(literal)
        literal = ""
        parts.append(alternatives if len(alternatives) > 1 else _range(pattern, alternatives[0]))
        i = j + 1
    parts.append(literal)
    return parts


def _range(pattern: str, body: str) -> list[str]:
    match = _RANGE.match(body)
    if not match:
        raise BraceError(f"{pattern!r}: {{{body}}} is neither a list {{a,b}} nor a range {{000..099}}")
    first, last, step = match.group(1), match.group(2), abs(int(match.group(3) or 1)) or 1
    width = len(first) if first.lstrip("-").startswith("0") and len(first) > 1 else 0
    lo, hi = int(first), int(last)
    count = abs(hi - lo) // step + 1
    if count > MAX_EXPANSION:
        raise BraceError(f"{pattern!r}: {{{body}}} names {count:,} shards, over {MAX_EXPANSION:,}")
    values = range(lo, hi + 1, step) if lo <= hi else range(lo, hi - 1, -step)
    return [str(v).zfill(width) for v in values]


def expansion_count(pattern: str) -> int:
    total = 1
    for part in _split(pattern):
        if isinstance(part, list):
            total *= sum(expansion_count(alt) for alt in part)
    return total


def expand_braces(pattern: str) -> Iterator[str]:
    """Every name the pattern stands for, in order (lazily)."""
    pieces = [[p] if isinstance(p, str) else list(itertools.chain.from_iterable(expand_braces(a) for a in p))
              for p in _split(pattern)]
    for combination in itertools.product(*pieces):
        yield "".join(combination)


def literal_prefix(pattern: str) -> str:
    """The text before the first brace: the listing need only look under it."""
    return pattern.split("{", 1)[0]


def check_pattern(pattern: str) -> int:
    """How many names the pattern stands for; raises BraceError for a broken or huge one."""
    count = expansion_count(pattern)
    if count > MAX_EXPANSION:
        raise BraceError(f"{pattern!r} names {count:,} shards, over {MAX_EXPANSION:,}")
    return count
