"""Each distinct media once per run in a process: the first (item, question) with given bytes
(its sha256; a group's hash of its members' hashes) goes to the engine, and every later one of the
same run with the same bytes and question takes that answer, in flight or done, with no request of
its own (its record's `duplicate_of` names the first one's key).

Kept per process and per run (`run_id`, a partition's own). Copies beyond it are found elsewhere:
of an item an earlier run captioned, through the done-index (tasks/results/copies.py); in another
partition of a fanned-out run, by the planner, which puts them in copy shards taken once their
originals are done (tasks/listed_copies.py, tasks/shard_plan.py). Its memory is one
small entry per distinct (media, question) of the run, the latest KEEP_ANSWERS: the first key and
the answer (its text and counts; no lock or future of its own: waiters share one condition).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from tasks.results.records import GenerationOutput

KEEP_RUNS = 2  # runs whose answers are kept (a worker runs one at a time; a second may be starting)
# Answers kept per run, the most recent: memory stays bounded (about a kilobyte each) however large
# the run; a copy whose first is older than that is captioned again.
KEEP_ANSWERS = 50_000


class CopyWithoutAnswer(RuntimeError):
    """The shard of the item a copy waited on failed (the copy's shard is retried)."""


class Claim:
    """One (media, question) of a run: the first item's key and, once the engine gave it, its answer."""

    __slots__ = ("key", "answer", "error")

    def __init__(self, key: str) -> None:
        self.key = key
        self.answer: GenerationOutput | None = None
        self.error: BaseException | None = None


class SameMedia:
    def __init__(self) -> None:
        self._settled = threading.Condition()
        self._runs: OrderedDict[str, OrderedDict[tuple[str, str], Claim]] = OrderedDict()

    def claim(self, run_id: str, media: str, question: str, key: str) -> tuple[Claim, bool]:
        """The run's claim on these bytes and question, and whether the caller is its first: the
        first asks the engine, then settles or forgets it; the others wait for its `answer`."""
        with self._settled:
            claims = self._runs.get(run_id)
            if claims is None:
                claims = self._runs[run_id] = OrderedDict()
                while len(self._runs) > KEEP_RUNS:
                    self._runs.popitem(last=False)  # a waiter holds its own claim: nothing hangs
            found = claims.get((media, question))
            if found is not None:
                return found, False
            made = claims[(media, question)] = Claim(key)
            if len(claims) > KEEP_ANSWERS:
                claims.popitem(last=False)  # its waiters hold the claim itself, and are still answered
            return made, True

    def settle(self, claim: Claim, answer: GenerationOutput) -> None:
        with self._settled:
            claim.answer = answer
            self._settled.notify_all()

    def forget(self, run_id: str, media_questions: list[tuple[str, str]], error: BaseException) -> None:
        """The first ones' shard failed: their copies raise `error` (their shard is retried and
        asks the engine itself), and the next (item, question) with these bytes is a first."""
        with self._settled:
            claims = self._runs.get(run_id, {})
            for mq in media_questions:
                dropped = claims.pop(mq, None)
                if dropped is not None and dropped.answer is None:
                    dropped.error = error
            self._settled.notify_all()

    def answer(self, claim: Claim) -> GenerationOutput:
        """The first one's answer, waited for while its shard is in the engine."""
        with self._settled:
            self._settled.wait_for(lambda: claim.answer is not None or claim.error is not None)
            if claim.answer is None:
                raise CopyWithoutAnswer(f"{claim.key}, whose answer this item takes, failed: "
                                        f"{type(claim.error).__name__}: {claim.error}") from claim.error
            return claim.answer


SAME_MEDIA = SameMedia()
