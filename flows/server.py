"""`vlm-caption server`: Prefect's server and its UI, started the one documented way; and the
check that a run's `PREFECT_API_URL` answers before anything heavy starts.

The server runs in its own environment (`uv tool run`), not the project's: vLLM 0.26 holds FastAPI
below 0.137, where Prefect's UI app cannot be built (`'FastAPI' object has no attribute 'frontend'`).
Prefect is pinned to the project's exact version, so server, workers and flow runs speak the same API."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

from vlm_caption.tasks.errors import PrefectUnavailable, UsageError
from vlm_caption.tasks.prefect_api import show_prefect_notice_now

# One FastAPI, checked with Prefect 3.8.8 on the operator's whole path (`prefect deploy --all`,
# `prefect deployment ls`, workers polling, runs and a fan-out; tests/test_deployments.py) and the
# UI's pages (tests/test_prefect_ui.py). A window is not safe: 0.154 starts and serves the UI but
# answers 422 to the explicit nulls Prefect's client sends (`limit: null` on
# /work_pools/.../workers/filter), so `prefect deploy --all` stops after the first deployment;
# 0.155 and later fail at start; the UI needs `FastAPI.frontend`, new in 0.139.
SERVER_FASTAPI = "fastapi==0.150.0"


class ServerError(UsageError):
    """A bad --host/--port, or no uv: one line for the user."""


class PrefectAPIUnreachable(PrefectUnavailable):
    """PREFECT_API_URL is set and nothing answers there."""


def browser_host(host: str) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"[{shown}]" if ":" in shown else shown


def check_port_free(host: str, port: int) -> None:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ServerError(f"cannot listen on host {host!r}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ServerError(f"port {port} on {host} is in use (another Prefect server?): "
                                  "stop it or pass --port") from None
            raise ServerError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


LEASES_ON_DISK = "prefect.server.concurrency.lease_storage.filesystem"
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


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


def serve(host: str, port: int, start: Callable[..., subprocess.Popen] = subprocess.Popen,
          stopped_by: str = "Ctrl-C stops the server") -> int:
    """Check the port, say where the UI and API are, then run the server until it ends or Ctrl-C
    (SIGINT, or SIGTERM) stops it."""
    check_port_free(host, port)
    uv, uvx = shutil.which("uv"), shutil.which("uvx")
    if not (uv or uvx):
        raise ServerError("`vlm-caption server` starts Prefect's server in its own environment with uv, "
                          "which is not on PATH: install it (`pip install uv`, or see "
                          "https://docs.astral.sh/uv/getting-started/installation/) and run it again")
    # Prefect at the project's exact version, with a FastAPI its server and UI work with, and the
    # project's SQLAlchemy (2.1 breaks Prefect 3.8's scheduler), run by `uv tool run` (or `uvx`).
    command = [*([uv, "tool", "run"] if uv else [uvx]), "--python",
               getattr(sys, "_base_executable", None) or sys.executable, "--from", f"prefect=={version('prefect')}",
               "--with", SERVER_FASTAPI, "--with", f"sqlalchemy=={version('sqlalchemy')}",
               "prefect", "server", "start", "--host", host, "--port", str(port)]
    url = f"http://{browser_host(host)}:{port}"
    # This shell's environment (PREFECT_HOME, the database URL, ...), less a PREFECT_API_URL that
    # may point elsewhere: the UI's browser side talks to this server's own API.
    env = {key: value for key, value in os.environ.items() if key not in ("PREFECT_API_URL", "VIRTUAL_ENV")}
    # Concurrency leases (the prod deployment's slot, each job's slot) kept on disk, not in the
    # server's memory: a restart mid-run otherwise forgets them, their slots are never freed and
    # the next nightly run waits forever.
    env.setdefault("PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE", LEASES_ON_DISK)
    if not (env.get("PREFECT_UI_API_URL") or env.get("PREFECT_SERVER_UI_API_URL")):
        env["PREFECT_UI_API_URL"] = f"{url}/api"
    databases = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")
    database = next((f"the database at {name}" for name in databases if env.get(name)),
                    f"SQLite in {prefect_home()} (PREFECT_HOME)")
    print(f"vlm-caption server: Prefect {version('prefect')} with its UI, in its own environment "
          f"(uv tool run, {SERVER_FASTAPI}); {database}.\n"
          f"  UI:  {url}\n"
          f"  In each shell that deploys, starts workers or runs flows:\n"
          f"    export PREFECT_API_URL={url}/api\n"
          f"  (The first start downloads Prefect's wheels. {stopped_by}.)", flush=True)
    show_prefect_notice_now(sys.stdout, import_now=True)
    sys.stderr.flush()
    # The server's output passes through here: once a stop is asked for, its shutdown's lines
    # (uvicorn's and Prefect's services' CancelledError tracebacks for every open connection,
    # many with workers attached) are dropped, and the stop is one line.
    server = start(command, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    stopping = threading.Event()
    copier = threading.Thread(target=_copy_output, args=(server.stdout, stopping), name="server-output", daemon=True)
    copier.start()

    def stop_asked(signum, frame):  # Ctrl-C, or a service manager's SIGTERM
        stopping.set()  # here, at once: Popen.wait holds a KeyboardInterrupt back for 0.25 s
        raise KeyboardInterrupt

    # (Set here also where the shell that started this in the background had SIGINT ignored.)
    previous = {sig: signal.signal(sig, stop_asked) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = server.wait()
    except KeyboardInterrupt:
        stopping.set()
        print("\nvlm-caption server: stopping ...", flush=True)
        code = _stop(server)
        print("vlm-caption server: stopped", flush=True)
        return 0 if code in (0, -signal.SIGINT, -signal.SIGTERM, 130) else code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    copier.join(timeout=5)
    return code


def _copy_output(stream, stopping: threading.Event) -> None:
    # Signals go to the main thread, waiting on the server: a Ctrl-C taken by this thread would
    # wait for the server to end before it was seen, with the shutdown's lines copied meanwhile.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    for line in iter(stream.readline, b""):
        if not stopping.is_set():
            sys.stdout.buffer.write(line)
            sys.stdout.flush()


def _stop(server: subprocess.Popen) -> int:
    """A Ctrl-C at a terminal reached the server too (one process group); a SIGTERM or a signal
    sent to this process alone did not: pass it on, and end it after 30 s if it has not ended."""
    for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        try:
            server.send_signal(sig)
            return server.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            if sig == signal.SIGINT:  # said, so that a pause of 30 s is not taken for a hang
                print(f"the Prefect server did not stop within {wait_s} s: killing it", file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, as asked
            pass
    return server.wait()


def check_api_reachable(timeout_s: float = 10.0) -> None:
    """With PREFECT_API_URL set (environment or profile), fail at once, before any engine starts, when
    nothing answers there (any HTTP answer, even 401, counts); without it there is nothing to check."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.settings import (PREFECT_API_REQUEST_TIMEOUT, PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES,
                                  temporary_settings)

    url = PREFECT_API_URL.value()
    if not url:
        return
    with temporary_settings({PREFECT_API_REQUEST_TIMEOUT: timeout_s, PREFECT_CLIENT_MAX_RETRIES: 1}):
        with get_client(sync_client=True) as client:
            problem = client.api_healthcheck()
    if problem is None or isinstance(problem, httpx.HTTPStatusError):
        return
    if isinstance(problem, httpx.TransportError):
        reason = str(problem).strip() or type(problem).__name__
        raise PrefectAPIUnreachable(
            f"cannot reach the Prefect API at {url} (PREFECT_API_URL; {reason}): start the server with "
            f"`vlm-caption server` (or point PREFECT_API_URL at yours), or unset PREFECT_API_URL to run "
            f"on Prefect's embedded server")


def pid_file(port: int) -> Path:
    return prefect_home() / f"vlm-caption-server-{port}.pid"


def background_pid(port: int) -> int | None:
    """The pid of the server `--background` started on this port, while it runs."""
    try:
        pid = int(pid_file(port).read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):  # no file, not a number, no such process
        return None
    cmdline = Path(f"/proc/{pid}/cmdline")  # empty for a process that has ended, else whose the pid is now
    return pid if not cmdline.exists() or b"flows.server" in cmdline.read_bytes() else None


def answers(url: str) -> bool:
    """Prefect's API at `url` answers its health check (no proxy: it is this host's)."""
    import httpx

    try:
        return httpx.get(f"{url}/api/health", timeout=2, trust_env=False).status_code == 200
    except (httpx.HTTPError, httpx.InvalidURL):
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
    show_prefect_notice_now(sys.stdout, import_now=True)  # Prefect's first-run notice: here, at the terminal
    print(f"vlm-caption server: starting in the background, its output in {log_path} (the first start "
          "downloads Prefect's wheels) ...", flush=True)
    with open(log_path, "ab") as out:
        child = subprocess.Popen([sys.executable, "-m", "vlm_caption.flows.server", host, str(port)],
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
