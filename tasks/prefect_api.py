"""What vlm-caption relies on of Prefect beyond flows, tasks and its client, through Prefect's public
settings and client only: the one module that knows it, so that a Prefect upgrade that changes any of
it fails tests/test_prefect_api.py instead of opening a quiet run's terminal.
- Prefect prints its first-run telemetry notice on `sys.stderr` while `import prefect` runs, where
  stdout or stderr is a terminal: `import_prefect` holds it, to be placed where a person reads it
  once (a quiet run's log, the start of `vlm-caption server`, before a command's one-line error).
- Without PREFECT_API_URL, Prefect's client starts its embedded server, a process of its own, once
  per process, with this process's environment, and stops it as the process exits. Prefect reads
  its settings as it is imported: `embedded_server_defaults` sets what `run` and `demo` need there.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import IO

# Prefect's settings for a run that may start its embedded server, where the user set none. Prefect
# gives the server 20 s to start: a fresh database's migrations on a busy 2-core machine take longer,
# and a new user's first run must not fail on it. Its SQLite waits 10 s for a lock by default: a busy
# machine needs longer. And it reports "database is locked" while its analytics run beside it.
EMBEDDED_SERVER_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "600",
    "PREFECT_SERVER_DATABASE_TIMEOUT": "60",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}

# What Prefect printed on stderr as it was first imported (its first-run telemetry notice; Prefect
# is imported once, so one at most), held for the run's terminal to place.
_held: list[str] = []


class _HeldStderr(io.StringIO):
    """stderr while Prefect is first imported: held, and a terminal where stderr is one, so that
    Prefect decides as it would whether to show its notice."""

    def __init__(self, real: IO[str]):
        super().__init__()
        self._real = real

    def isatty(self) -> bool:
        try:
            return self._real.isatty()
        except (AttributeError, ValueError):
            return False


def import_prefect() -> None:
    """Import Prefect now, holding what it prints on stderr as it starts (its first-run notice).
    The CLI calls it before anything else imports Prefect; once Prefect is imported it does
    nothing (Prefect has decided)."""
    if "prefect" in sys.modules:
        return
    said = _HeldStderr(sys.stderr)
    with contextlib.redirect_stderr(said):
        import prefect  # noqa: F401 - Prefect decides on its import whether to show its notice
    if said.getvalue().strip():
        _held.append(said.getvalue())
        atexit.register(release_notice, None)


def release_notice(terminal: IO[str] | None) -> None:
    """The held notice: whole on stderr (the log, in a quiet run), and one line of ours on the
    quiet run's `terminal`."""
    if not _held:
        return
    print(_held.pop(), file=sys.stderr, flush=True)
    if terminal is not None:
        print("vlm-caption: Prefect's first-run telemetry notice is in the log (to opt out of Prefect's "
              "usage data: DO_NOT_TRACK=1)", file=terminal)


def show_prefect_notice_now(file: IO[str], *, import_now: bool = False) -> None:
    """Prefect's first-run notice, where Prefect has one for this terminal, printed now: at the start of
    `vlm-caption server` (not in the middle of `prefect deploy` later), or before a command's error."""
    if import_now:
        import_prefect()
    if _held:
        print(_held.pop().strip(), file=file, flush=True)


@contextlib.contextmanager
def embedded_server_defaults(active: bool = True) -> Iterator[None]:
    """EMBEDDED_SERVER_DEFAULTS in this process's environment while a command runs, each where the
    environment has none (a user's own value wins), then taken out again. Not `active`: nothing changes."""
    added = {name: value for name, value in EMBEDDED_SERVER_DEFAULTS.items() if active and name not in os.environ}
    os.environ.update(added)
    # Prefect reads its settings from the environment when it is first imported: where a caller imported
    # it before the command began (a script that imports the flow, then calls `main`), the values are set
    # in Prefect's settings too, with Prefect's own `temporary_settings`.
    loaded = contextlib.nullcontext()
    if added and "prefect.settings" in sys.modules:
        import prefect.settings

        loaded = prefect.settings.temporary_settings(updates={getattr(prefect.settings, name): value
                                                              for name, value in added.items()})
    try:
        with loaded:
            yield
    finally:
        for name, value in added.items():
            if os.environ.get(name) == value:
                del os.environ[name]
