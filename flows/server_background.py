"""`vlm-caption server --background` and `--stop`: the server `vlm-caption server` runs
(flows/server.py), started in a session of its own with its output in a log file, so the
operator's shell gets one line and its prompt back once the API answers; its pid is kept in
PREFECT_HOME (`vlm-caption-server-<port>.pid`) for `--stop`.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vlm_caption.flows.server import ServerError, browser_host, check_port_free, prefect_home, serve

STOP_HINT = "`vlm-caption server --stop` stops it"


def server_command(args) -> int:
    """`vlm-caption server`: in the foreground (Ctrl-C stops it), `--background` or `--stop`."""
    if args.background and args.stop:
        raise ServerError("--background starts a server, --stop stops one: give one of them")
    if args.stop:
        return stop_background(args.port)
    if args.background:
        return serve_in_background(args.host, args.port, args.log)
    return serve(args.host, args.port)


def pid_file(port: int) -> Path:
    return prefect_home(dict(os.environ)) / f"vlm-caption-server-{port}.pid"


def background_pid(port: int) -> int | None:
    """The pid of the server `--background` started on this port, while it runs."""
    try:
        pid = int(pid_file(port).read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):  # no file, not a number, no such process
        return None
    cmdline = Path(f"/proc/{pid}/cmdline")  # empty for a process that has ended, else whose the pid is now
    return pid if not cmdline.exists() or b"flows.server_background" in cmdline.read_bytes() else None


def answers(url: str) -> bool:
    """Prefect's API at `url` answers its health check (no proxy: it is this host's)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{url}/api/health", timeout=2) as response:
            return response.status == 200
    except (OSError, ValueError, http.client.HTTPException):
        return False


def serve_in_background(host: str, port: int, log: str, timeout_s: float = 600) -> int:
    """Start the server in a session of its own, its output in `log`; return once its API answers
    (or it is already running), with one line saying where it is."""
    url = f"http://{browser_host(host)}:{port}"
    running = background_pid(port)
    if running and answers(url):
        print(f"vlm-caption server: already running at {url} (pid {running}); {STOP_HINT}")
        return 0
    check_port_free(host, port)
    log_path = Path(log).resolve()
    from vlm_caption.tasks.prefect_api import show_prefect_notice_now

    show_prefect_notice_now(sys.stdout, import_now=True)  # Prefect's first-run notice: here, at the terminal
    print(f"vlm-caption server: starting in the background, its output in {log_path} (the first start "
          "downloads Prefect's wheels) ...", flush=True)
    with open(log_path, "ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "vlm_caption.flows.server_background", host, str(port)],
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    pid_file(port).parent.mkdir(parents=True, exist_ok=True)
    pid_file(port).write_text(f"{child.pid}\n")
    deadline = time.monotonic() + timeout_s
    try:
        while not answers(url):
            if child.poll() is not None:
                raise ServerError(f"the server stopped as it started (exit {child.returncode}): see {log_path}")
            if time.monotonic() > deadline:
                raise ServerError(f"the server did not answer at {url} within {timeout_s:.0f} s: see {log_path}")
            time.sleep(0.5)
    except BaseException:  # its error, or a Ctrl-C while it starts: nothing is left running
        stop_background(port, quiet=True)
        raise
    print(f"vlm-caption server: up at {url} (its UI; the API: {url}/api), pid {child.pid}; {STOP_HINT}", flush=True)
    return 0


def stop_background(port: int, quiet: bool = False) -> int:
    """End the server `--background` started on this port: SIGTERM (it stops as at a Ctrl-C), and
    after 45 s, or once it has ended, SIGKILL to whatever is left of its session's process group."""
    pid = background_pid(port)
    if pid is None:
        pid_file(port).unlink(missing_ok=True)
        if quiet:
            return 0
        raise ServerError(f"no server started by `vlm-caption server --background` runs on port {port}")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 45
    while background_pid(port) == pid and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):  # nothing was left
        os.killpg(pid, signal.SIGKILL)
    pid_file(port).unlink(missing_ok=True)
    if not quiet:
        print(f"vlm-caption server: stopped (pid {pid})")
    return 0


if __name__ == "__main__":  # the server process `serve_in_background` starts
    sys.exit(serve(sys.argv[1], int(sys.argv[2]), stopped_by=STOP_HINT))
