"""The kinds of error a user can cause or fix, each with its exit code (docs/operations.md, "Exit
codes"). They are `UserError`s (recipes/errors.py: the one base, in the lowest layer, so that the
recipes' `RecipeError` is one too): the CLI prints the message without a traceback and exits with the
kind's `exit_code` (2 for a `UserError` itself; 1 is an unexpected error); a flow run that raises one
fails with that message (at once when `permanent`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from vlm_caption.recipes.errors import UserError

__all__ = ["BusyError", "EngineFailure", "FanOutFailure", "OutOfSpaceError", "PrefectUnavailable", "UsageError",
           "UserError", "failure_of", "free_space", "is_permanent", "retry_unless_permanent"]


class UsageError(UserError, ValueError):
    """An option or job field that cannot be used as given."""

    exit_code = 2


class PrefectUnavailable(UserError):
    """Prefect's API is not there: a PREFECT_API_URL nobody answers, or an embedded server that
    did not start. Retried in a flow run (the API may come back)."""

    exit_code = 3
    permanent = False


class BusyError(UserError):
    """Another run holds what this one needs; running again later works."""

    exit_code = 4
    permanent = False


class OutOfSpaceError(UserError):
    """No room left where results are written; permanent until someone makes room."""

    exit_code = 5


def free_space(path: str | Path) -> tuple[int | None, Path]:
    """Free bytes on the file system where `path` is (or will be created: its nearest existing
    folder), and that folder; None where it cannot be told."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free, folder
    except OSError:
        return None, folder


class EngineFailure(UserError):
    """The engine stopped mid-run (its process killed, the host out of memory): retried."""

    exit_code = 6
    permanent = False


class FanOutFailure(UserError):
    """A fanned-out run cannot start or run its partitions."""

    exit_code = 7


def is_permanent(exc: BaseException) -> bool:
    """A user error that a retry would only repeat."""
    return isinstance(exc, UserError) and exc.permanent


def failure_of(state) -> BaseException | None:
    """The exception a failed Prefect state holds (its data, or the result record holding it)."""
    data = getattr(state, "data", None)
    failure = getattr(data, "result", data)
    return failure if isinstance(failure, BaseException) else None


def retry_unless_permanent(task, task_run, state) -> bool:
    """A task's `retry_condition_fn`: any failure is tried again but a permanent one (a full disk)."""
    failure = failure_of(state)
    return failure is None or not is_permanent(failure)
