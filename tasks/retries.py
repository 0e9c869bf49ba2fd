"""A shard step tried again in this process: what Prefect's task retries did when each shard's
step was a task run of its own (the steps are plain functions now, flows/shard_steps.py).

One rule for every step: a failure that a retry would only repeat (`tasks/errors.py`
`is_permanent`: a full disk) is raised at once; any other (an engine that died, a storage call
failing past the client's own retries) is tried again, after a pause, up to the step's count."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from vlm_caption.tasks.errors import is_permanent
from vlm_caption.tasks.observability import get_logger

T = TypeVar("T")


@dataclass(frozen=True)
class Retries:
    """How often a step is tried again (`count`, after the first try) and the pause before each."""

    count: int
    delay_s: float = 0.0

    def call(self, step: Callable[[], T], what: str, **context) -> T:
        """`step()`, tried again while it fails with a failure that may pass; the last failure, or
        a permanent one, is raised. `what` and `context` name the step in the log's warning."""
        for attempt in range(1, self.count + 1):
            try:
                return step()
            except Exception as exc:
                if is_permanent(exc):
                    raise
                get_logger().warning(f"{what} failed; trying again", attempt=attempt, of=self.count + 1,
                                     error=f"{type(exc).__name__}: {exc}", **context)
                time.sleep(self.delay_s)
        return step()
