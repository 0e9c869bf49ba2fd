"""What tasks/prefect_api.py relies on of Prefect, checked against the installed Prefect: a test
here failing after a Prefect upgrade names what changed, before a user's terminal shows it."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
# The variables by which Prefect 3.8 takes a process for CI (and shows no notice), and its opt-out.
NO_TELEMETRY = ("CI", "GITHUB_ACTIONS", "GITLAB_CI", "JENKINS_URL", "TRAVIS", "CIRCLECI", "BUILDKITE", "TF_BUILD",
                "CODEBUILD_BUILD_ID", "BITBUCKET_COMMIT", "TEAMCITY_VERSION", "DRONE", "SEMAPHORE", "APPVEYOR",
                "BUDDY", "CI_NAME", "DO_NOT_TRACK")


def telemetry_on_with_a_fresh_home(home: Path) -> dict[str, str]:
    """An environment in which Prefect shows its first-run notice at a terminal, as on a new
    user's machine: telemetry on, a PREFECT_HOME never used."""
    env = {key: value for key, value in os.environ.items() if key not in NO_TELEMETRY}
    env["PREFECT_HOME"] = str(home)
    return env


def test_prefect_prints_its_first_run_notice_as_it_is_imported_and_import_prefect_holds_it(tmp_path):
    from tests.terminal_io import run_in_a_terminal

    script = """
import sys
from tasks.prefect_api import import_prefect, show_prefect_notice_now
import_prefect()
from prefect.analytics import is_telemetry_enabled
assert is_telemetry_enabled(), "telemetry is off in this environment: the test cannot see the notice"
print("-- imported --", flush=True)
show_prefect_notice_now(sys.stdout)
print("-- end --", flush=True)
"""
    code, screen = run_in_a_terminal([sys.executable, "-c", script],
                                     env=telemetry_on_with_a_fresh_home(tmp_path / "home"), timeout=120)
    assert code == 0, screen
    before, _, after = screen.partition("-- imported --")
    assert "anonymous usage data" not in before, f"Prefect's notice was not held as Prefect was imported:\n{screen}"
    assert "anonymous usage data" in after.partition("-- end --")[0], (
        f"Prefect no longer prints its first-run notice while `import prefect` runs (tasks/prefect_api.py "
        f"holds what it prints then):\n{screen}")


def test_the_embedded_server_and_the_workers_drain_are_where_the_adapter_reaches_them():
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer

    assert SubprocessASGIServer() is SubprocessASGIServer(), "the embedded server is no longer one per process"
    for attribute in ("running", "stop", "start"):
        assert hasattr(SubprocessASGIServer(), attribute), f"SubprocessASGIServer has no {attribute}"
    for worker in (APILogWorker, EventsWorker):
        assert "timeout" in inspect.signature(worker.drain_all).parameters, f"{worker.__name__}.drain_all changed"


@pytest.mark.timeout(600)
def test_a_flow_run_on_the_embedded_server_is_stopped_now_with_its_logs_sent(tmp_path):
    """Without PREFECT_API_URL a flow run starts Prefect's embedded server; `running_embedded_server`
    finds it and `drain_and_stop` stops it at once, after its log lines are sent: nothing is left for
    the process's exit to say (Prefect's "Stopping temporary server", "Error logging to API")."""
    script = """
from prefect import flow, get_run_logger
from tasks.prefect_api import drain_and_stop, running_embedded_server

assert running_embedded_server() is None

@flow
def hello():
    for n in range(50):
        get_run_logger().info(f"a line for the API {n}")

hello()
server = running_embedded_server()
assert server is not None, "a flow run without PREFECT_API_URL started no SubprocessASGIServer()"
drain_and_stop(server)
assert running_embedded_server() is None and server.server_process is None, "the embedded server still runs"
print("-- stopped --", flush=True)
"""
    done, output = _run_without_api_url(script, tmp_path)
    assert "Stopping temporary server" in done.stderr, output[-3000:]  # Prefect's line, now
    at_exit = done.stderr.split("Stopping temporary server", 1)[1]
    assert "Stopping temporary server" not in at_exit and "Error logging to API" not in at_exit, output[-3000:]


@pytest.mark.timeout(600)
def test_an_embedded_server_started_early_is_the_one_the_flow_run_uses(tmp_path):
    """`vlm-caption run` starts the embedded server on a thread before it imports the flow (a night
    with earlier results): the flow run then finds it up, and no second server starts."""
    script = """
from prefect import flow
from tasks.prefect_api import drain_and_stop, running_embedded_server, start_embedded_server_early

wait = start_embedded_server_early()
wait()
server = running_embedded_server()
assert server is not None, "no embedded server after the early start"

@flow
def hello():
    return 1

assert hello() == 1
assert running_embedded_server() is server
drain_and_stop(server)
"""
    _, output = _run_without_api_url(script, tmp_path)
    assert output.count("Starting temporary server") == 1, output[-3000:]


def test_no_embedded_server_is_started_early_where_the_run_has_an_api_url():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.prefect_api import running_embedded_server, start_embedded_server_early

    before = running_embedded_server()
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        start_embedded_server_early()()
    assert running_embedded_server() is before


def _run_without_api_url(script: str, tmp_path) -> tuple[subprocess.CompletedProcess, str]:
    """`script` in a Python of its own with no PREFECT_API_URL and a fresh PREFECT_HOME (so its
    flow runs start Prefect's embedded server), asserted to succeed; its output returned too."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_API_URL")}
    env["PREFECT_HOME"] = str(tmp_path / "home")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=570)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return done, output
