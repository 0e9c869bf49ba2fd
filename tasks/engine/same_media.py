"""Each distinct media once per run in a process: the first (item, question) with given bytes
(its sha256; a group's hash of its members' hashes) goes to the engine, and every later one of the
same run with the same bytes and question takes that answer, in flight or done, with no request of
its own (its record's `duplicate_of` names the first one's key).

Kept per process and per run (`run_id`, a partition's own): a copy in another partition of a
fanned-out run, or of an item captioned by an earlier run, is captioned again. Its memory is one
entry per distinct (media, question) of the run: the first key and the answer (text and counts).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from tasks.results.records import GenerationOutput

KEEP_RUNS = 2  # runs whose answers are kept (a worker runs one at a time; a second may be starting)


@dataclass
class Claim:
    """One (media, question) of a run: the first item's key and its answer once the engine gave it."""

    key: str
    answer: Future = field(default_factory=Future)  # of GenerationOutput
    first: bool = True  # whether the caller is that first item (it must settle or forget it)

    def settle(self, answer: GenerationOutput) -> None:
        if not self.answer.done():
            self.answer.set_result(answer)


class SameMedia:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: OrderedDict[str, dict[tuple[str, str], Claim]] = OrderedDict()

    def claim(self, run_id: str, media: str, question: str, key: str) -> Claim:
        """The run's claim on these bytes and question: `first` when the caller is the first
        (it asks the engine, then settles it or forgets it), else the first one's key and answer."""
        with self._lock:
            claims = self._runs.get(run_id)
            if claims is None:
                claims = self._runs[run_id] = {}
                while len(self._runs) > KEEP_RUNS:
                    self._runs.popitem(last=False)  # a waiter holds its own claim: nothing hangs
            found = claims.get((media, question))
            if found is not None:
                return Claim(found.key, found.answer, first=False)
            made = claims[(media, question)] = Claim(key)
            return made

    def forget(self, run_id: str, media_questions: list[tuple[str, str]], error: BaseException) -> None:
        """The first ones' shard failed: their copies raise `error` (their shard is retried and
        asks the engine itself), and the next (item, question) with these bytes is a first."""
        with self._lock:
            claims = self._runs.get(run_id, {})
            dropped = [claims.pop(mq, None) for mq in media_questions]
        for claim in dropped:
            if claim is not None and not claim.answer.done():
                claim.answer.set_exception(error)


SAME_MEDIA = SameMedia()
