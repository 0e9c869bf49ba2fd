"""Caption checks made inline, as each record is made: a caption that loops, is empty, was cut by
`max_tokens`, or (structured outputs) fails its schema gets `quality` flags. Pure functions: the
text and the finish reason in, the flags out.

Looping, with the thresholds below (few false positives on ordinary prose; a degenerate model
trips them): a unit of 1 to 8 words repeated back to back, a 6-word sequence found again anywhere
in the text (the loop a long unit makes), or the text ending in a short unit of characters repeated
(loops without spaces: "!!!!...", CJK text, sub-word gibberish). Words are compared lower-cased,
punctuation left out.
"""

from __future__ import annotations

import re
from collections import Counter

LOOPING, EMPTY, TRUNCATED, SCHEMA = "looping", "empty", "truncated", "schema"  # a record's flags, in this order
RETRY_FLAGS = frozenset({LOOPING, EMPTY})  # what asking again with other sampling can mend

MAX_UNIT_WORDS = 8
SINGLE_WORD_REPEATS = 5  # "the the the the the"
UNIT_REPEATS = 3  # a unit of 2..8 words back to back: "a red car a red car a red car"
NGRAM_WORDS, NGRAM_REPEATS = 6, 3  # the same 6 words three times anywhere
MAX_UNIT_CHARS, CHAR_REPEATS, CHAR_LOOP_MIN = 32, 5, 40  # a unit of 1..32 characters 5 times, 40 at least

_WORD = re.compile(r"\w+")


def _back_to_back(tokens: list[str]) -> bool:
    """A unit of 1..MAX_UNIT_WORDS words repeated consecutively past its threshold."""
    count = len(tokens)
    for size in range(1, MAX_UNIT_WORDS + 1):
        need = SINGLE_WORD_REPEATS if size == 1 else UNIT_REPEATS
        if count < size * need:
            break
        run = 0  # positions i where tokens[i] == tokens[i - size], in a row
        for i in range(size, count):
            run = run + 1 if tokens[i] == tokens[i - size] else 0
            if run >= size * (need - 1):  # the unit and (need - 1) copies of it
                return True
    return False


def _ngram_recurs(tokens: list[str]) -> bool:
    if len(tokens) < NGRAM_WORDS * NGRAM_REPEATS:
        return False
    grams = Counter(tuple(tokens[i:i + NGRAM_WORDS]) for i in range(len(tokens) - NGRAM_WORDS + 1))
    return grams.most_common(1)[0][1] >= NGRAM_REPEATS


def _suffix_repeats(text: str) -> bool:
    """The text ends in a short unit of characters repeated CHAR_REPEATS times, over CHAR_LOOP_MIN."""
    text = text.rstrip()
    for size in range(1, MAX_UNIT_CHARS + 1):
        unit = text[-size:]
        if len(text) < size * CHAR_REPEATS:
            break
        reps, end = 1, len(text) - size
        while end >= size and text[end - size:end] == unit:
            reps, end = reps + 1, end - size
        if reps >= CHAR_REPEATS and reps * size >= CHAR_LOOP_MIN:
            return True
    return False


def is_looping(text: str | None) -> bool:
    """Whether the text loops (the rules in this module's docstring)."""
    if not text:
        return False
    tokens = [word.lower() for word in _WORD.findall(text)]
    return _back_to_back(tokens) or _ngram_recurs(tokens) or _suffix_repeats(text)


def caption_flags(text: str | None, finish_reason: str | None, schema_failed: bool = False,
                  prose: bool = True) -> list[str]:
    """The flags of one answer, in their order ([] when it is fine). A structured answer (`prose`
    false: JSON, a regex, a choice) is not checked for loops: its form repeats by design (a list
    of objects with the same keys), and one that runs on is cut and fails its schema instead."""
    flags = []
    if prose and is_looping(text):
        flags.append(LOOPING)
    if not (text or "").strip():
        flags.append(EMPTY)
    if finish_reason == "length":
        flags.append(TRUNCATED)
    if schema_failed:
        flags.append(SCHEMA)
    return flags


def wants_retry(flags: list[str]) -> bool:
    """An answer worth asking again for, with other sampling (a cut or a schema miss is not)."""
    return bool(RETRY_FLAGS.intersection(flags))


def better(first: list[str], second: list[str]) -> bool:
    """Whether the second answer (with these flags) is better than the first: fewer looping or
    empty flags, then fewer flags; a tie keeps the first."""
    def rank(flags: list[str]) -> tuple[int, int]:
        return len(RETRY_FLAGS.intersection(flags)), len(flags)

    return rank(second) < rank(first)
