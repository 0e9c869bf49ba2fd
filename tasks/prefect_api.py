"""What vlm-caption relies on of Prefect beyond flows, tasks and its client: the one module that
knows it, so that a Prefect upgrade that changes any of it fails tests/test_prefect_api.py
instead of opening a quiet run's terminal.

It uses no private name of Prefect. What it relies on, each part of Prefect's public modules:
- Prefect prints its first-run telemetry notice on `sys.stderr` while `import prefect` runs, and
  only where stdout or stderr is a terminal (and this PREFECT_HOME has not shown it; DO_NOT_TRACK=1
  or a CI variable turn it off with Prefect's usage data). `import_prefect` does that first import
  with stderr held, so the notice is placed where a person reads it once: in a quiet run's log with
  one line of ours on the terminal (tasks/terminal.py), at the start of `vlm-caption server`, or
  before a command's one-line error; anything else gets it on stderr as the process ends.
- `prefect.server.api.server.SubprocessASGIServer()` (no port) is the embedded API server Prefect's
  client starts when PREFECT_API_URL is unset and PREFECT_SERVER_EPHEMERAL_ENABLED is on (one
  instance per process, as Prefect's test harness also uses it), with `start()` (it waits until
  the server answers; once started, a later call does nothing), `running` and `stop()`.
- `prefect.logging.handlers.APILogWorker.drain_all(timeout=)` and
  `prefect.events.worker.EventsWorker.drain_all(timeout=)` send what the log and event workers hold
  (Prefect's test harness drains them so before it stops its server).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

# What Prefect printed on stderr as it was first imported (its first-run telemetry notice), held
# for the run's terminal to place.
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
    text = "".join(_held)
    _held.clear()
    print(text, file=sys.stderr, flush=True)
    if terminal is not None:
        print("vlm-caption: Prefect's first-run telemetry notice is in the log (to opt out of Prefect's "
              "usage data: DO_NOT_TRACK=1)", file=terminal)


def show_prefect_notice_now(file: IO[str], *, import_now: bool = False) -> None:
    """Prefect's first-run notice, where Prefect has one for this terminal, printed now: at the
    start of `vlm-caption server` (the first command of the operator's path, so the notice is
    not in the middle of `prefect deploy` later: Prefect shows it once per PREFECT_HOME), or
    before a command's one-line error (not after it, as the process ends)."""
    if import_now:
        import_prefect()
    if _held:
        text = "".join(_held).strip()
        _held.clear()
        print(text, file=file, flush=True)


def running_embedded_server() -> Any | None:
    """Prefect's embedded API server, where this process runs one (a run without PREFECT_API_URL
    started it, or a test harness did); None otherwise. Nothing is imported for a process whose
    Prefect never started one. (The CLI could start it itself, `SubprocessASGIServer().start()`,
    but that would wait for it before the engine's start, which now overlaps it.)"""
    server = sys.modules.get("prefect.server.api.server")
    if server is None:
        return None
    embedded = server.SubprocessASGIServer()
    return embedded if embedded.running else None


def start_embedded_server_early() -> Callable[[], None]:
    """Start Prefect's embedded server now, on a thread, where the run would start it (no
    PREFECT_API_URL): its process starts while this one imports the flow and begins a nightly
    run's listing. Returns what waits for it, which the caller calls before its first use of
    Prefect's client: a start that failed is left to that client, which starts it again and
    raises its own error."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return lambda: None
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()

    def start() -> None:
        with contextlib.suppress(Exception):  # the client's own start raises it, with its message
            server.start()

    thread = threading.Thread(target=start, name="vlm-caption-prefect-server", daemon=True)
    thread.start()
    return thread.join


def drain_and_stop(embedded: Any, timeout_s: float = 30) -> None:
    """Send what Prefect's log and event workers hold (else they find no server at exit), then
    stop the embedded server now: Prefect stops it at exit, with a log line on the terminal."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    try:
        for worker in (APILogWorker, EventsWorker):
            worker.drain_all(timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - the run is over: nothing here may fail it
        print(f"vlm-caption: Prefect's log and event workers not drained ({type(exc).__name__}: {exc}); "
              "their last lines may be missing from the API", file=sys.stderr)  # the run's log
    try:
        embedded.stop()
    except Exception as exc:  # noqa: BLE001 - Prefect stops it at exit instead
        print(f"vlm-caption: Prefect's embedded server not stopped now ({type(exc).__name__}: {exc}); "
              "it stops as the process ends", file=sys.stderr)
