"""Every process the bench starts is ended by it, whichever way the bench ends (issue 68: a
failed bench test had left its Prefect server, its loopback moto S3 and a worker running).

`started` starts a process in a session of its own and, on the way out of its `with` (a return,
an exception, a Ctrl-C, the SIGTERM `sigterm_raises` turns into SystemExit), ends it with
`stop_tree`: the process, everything under it (a worker's flow run, a phase's engine core and
Prefect server) and whatever is left of its process group (a child whose parent died first)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import IO, Any


@contextlib.contextmanager
def started(command: list[str], grace: float = 5.0, **popen: Any) -> Iterator[subprocess.Popen]:
    """`subprocess.Popen(command, **popen)` in a new session, stopped with all it started when
    the block ends, however it ends (within `grace` seconds of SIGTERM, then SIGKILL)."""
    proc = subprocess.Popen(command, start_new_session=True, **popen)
    try:
        yield proc
    finally:
        stop_tree(proc, grace)


def run_to_end(command: list[str], timeout: float | None = None, grace: float = 5.0,
               **popen: Any) -> tuple[int, str, str]:
    """`command` run (as `started` runs it) to its end: its exit code, stdout and stderr, read
    from files (`output_file`)."""
    with output_file() as out, output_file() as err, started(command, grace, stdout=out, stderr=err, **popen) as proc:
        proc.wait(timeout=timeout)
        return proc.returncode, read_all(out), read_all(err)


def output_file() -> IO[str]:
    """A process's output goes to a file, not a pipe: a child it left behind would hold a pipe
    open, and its reader waiting, past its end (as a phase's engine core or Prefect server would)."""
    return tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")


def read_all(file: IO[str]) -> str:
    file.seek(0)
    return file.read()


def _members(proc: subprocess.Popen) -> list:
    """The process (while not reaped), its descendants, and what is left in its process group."""
    import psutil

    found: dict[int, psutil.Process] = {}
    if proc.returncode is None:
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(proc.pid)
            found = {p.pid: p for p in (top, *top.children(recursive=True))}
    for other in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if other.pid not in found and os.getpgid(other.pid) == proc.pid:
                found[other.pid] = other
    return list(found.values())


def stop_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """End `proc` (started in a session of its own) and everything it started: SIGTERM to each,
    SIGKILL to what is left after `grace` seconds; `proc` reaped. A process already gone is no
    error, and what it left behind in its group is ended too."""
    import psutil

    members = _members(proc)
    for member in members:
        with contextlib.suppress(psutil.Error):
            member.terminate()
    ends_at = time.monotonic() + grace
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)  # by Popen, which keeps its exit code (psutil would reap it unseen)
    others = [member for member in members if member.pid != proc.pid]
    _, alive = psutil.wait_procs(others, timeout=max(0.0, ends_at - time.monotonic()))
    for member in alive + ([psutil.Process(proc.pid)] if proc.poll() is None else []):
        with contextlib.suppress(psutil.Error):
            member.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything that joined the group since
    psutil.wait_procs(alive, timeout=5)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While the block runs (in the main thread), SIGTERM raises SystemExit(143), so that every
    `finally` and `with` of the bench runs and stops what it started (by default SIGTERM ends
    Python at once, its children orphaned); a second SIGTERM during that clean-up is ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@contextlib.contextmanager
def settings_environment(env: dict[str, str]) -> Iterator[None]:
    """This process's environment with `env` set, and the settings read from it, until the block
    ends (then both as they were): a loopback S3 server's endpoint and keys, for the bench and the
    tests."""
    from vlm_caption.tasks.settings import get_settings

    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    get_settings.cache_clear()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        get_settings.cache_clear()
