"""What tasks/prefect_api.py relies on of Prefect, checked against the installed Prefect: a test
here failing after a Prefect upgrade names what changed, before a user's terminal shows it."""

from __future__ import annotations

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
from vlm_caption.tasks.prefect_api import import_prefect, show_prefect_notice_now
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


def test_the_settings_and_the_client_the_adapter_uses_are_prefects_public_ones():
    import inspect

    from prefect.client.orchestration import SyncPrefectClient, get_client
    from prefect.settings import (PREFECT_SERVER_ANALYTICS_ENABLED, PREFECT_SERVER_DATABASE_TIMEOUT,
                                  PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)

    from vlm_caption.tasks.prefect_api import EMBEDDED_SERVER_DEFAULTS

    settings = (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, PREFECT_SERVER_DATABASE_TIMEOUT,
                PREFECT_SERVER_ANALYTICS_ENABLED)
    assert {setting.name for setting in settings} == set(EMBEDDED_SERVER_DEFAULTS), "a setting was renamed"
    assert "sync_client" in inspect.signature(get_client).parameters and hasattr(SyncPrefectClient, "api_healthcheck")


def test_product_code_names_no_prefect_internals():
    names = ("SubprocessASGIServer", "drain_all", "prefect._internal", "prefect.server.api")
    found = [f"{path}: {name}" for folder in ("flows", "tasks", "recipes") for path in (REPO / folder).rglob("*.py")
             for name in names if name in path.read_text()]
    assert not found, found


def test_importing_the_package_changes_no_prefect_setting():
    """Prefect's settings come from the environment: the CLI sets what a run needs as it begins."""
    script = """
import os
prefects = lambda: {name: value for name, value in os.environ.items() if name.startswith("PREFECT_")}
before = prefects()
import vlm_caption.flows.cli, vlm_caption.flows.caption, vlm_caption.flows.demo, vlm_caption.flows.server
import vlm_caption.tasks.prefect_api, vlm_caption.tasks.terminal, vlm_caption.recipes
assert prefects() == before, set(prefects().items()) ^ set(before.items())
from vlm_caption.tasks.prefect_api import EMBEDDED_SERVER_DEFAULTS, embedded_server_defaults
with embedded_server_defaults():
    assert all(os.environ[name] for name in EMBEDDED_SERVER_DEFAULTS)
assert prefects() == before, "embedded_server_defaults left its settings behind"
"""
    from vlm_caption.tasks.prefect_api import EMBEDDED_SERVER_DEFAULTS

    env = {key: value for key, value in os.environ.items() if key not in EMBEDDED_SERVER_DEFAULTS}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.timeout(600)
def test_a_quiet_run_on_the_embedded_server_leaves_its_stop_to_prefect_and_its_goodbye_in_the_log(tmp_path):
    """Without PREFECT_API_URL a flow run starts Prefect's embedded server, which Prefect stops as the
    process exits, after its log workers have sent what they hold: what it says then (Prefect's
    "Stopping temporary server") goes to the quiet run's log, nothing after the summary on the terminal."""
    log = tmp_path / "logs" / "run.log"
    script = f"""
from pathlib import Path
from vlm_caption.tasks.prefect_api import embedded_server_defaults

with embedded_server_defaults():
    from prefect import flow, get_run_logger
    from vlm_caption.tasks.terminal import quiet_terminal

    @flow
    def hello():
        for n in range(50):
            get_run_logger().info(f"a line for the API {{n}}")

    with quiet_terminal(Path({str(log)!r})):
        hello()
    print("the summary", flush=True)
"""
    done, output = _run_without_api_url(script, tmp_path)
    assert done.stdout == "the summary\n", output[-3000:]
    assert done.stderr == f"vlm-caption: the run's log (Prefect, vLLM): {log}\n", output[-3000:]
    kept = log.read_text()
    assert "Starting temporary server" in kept and "Stopping temporary server" in kept, kept[-3000:]
    assert "Error logging to API" not in kept, kept[-3000:]


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


def test_the_embedded_servers_defaults_reach_a_prefect_imported_before_the_command(monkeypatch):
    """A script that imports the flow (and so Prefect, which reads its settings then) before it
    calls `main` still gets the embedded server's defaults, in Prefect's own settings."""
    from prefect.settings import get_current_settings

    from vlm_caption.tasks.prefect_api import EMBEDDED_SERVER_DEFAULTS, embedded_server_defaults

    for name in EMBEDDED_SERVER_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    before = get_current_settings().server
    assert before.ephemeral.startup_timeout_seconds != 600
    with embedded_server_defaults():
        inside = get_current_settings().server
        assert (inside.ephemeral.startup_timeout_seconds, inside.database.timeout) == (600, 60)
        assert inside.analytics_enabled is False
    after = get_current_settings().server
    assert after.ephemeral.startup_timeout_seconds == before.ephemeral.startup_timeout_seconds
    assert not any(name in os.environ for name in EMBEDDED_SERVER_DEFAULTS)
