"""The Prefect UI as an operator sees it: `vlm-caption server` started the documented way, the
demo run against it, and the run's pages opened in headless Chromium (the run, its state, its
readable log lines, the summary table and the sample captions). Plus the server's bad inputs, a
run whose PREFECT_API_URL nobody answers, and the log lines' two formats (people, machines)."""

from __future__ import annotations

import html
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from vlm_caption.flows import cli
from tests.conftest import free_port
from tests.result_files import records as result_records
from tests.terminal_io import assert_quiet_terminal, run_in_a_terminal

EXE = Path(sys.executable).with_name("vlm-caption")
# Screenshots kept for a person to look at (CI can upload the folder); ignored by git.
ARTIFACTS = Path(__file__).parent / "artifacts" / "prefect-ui"
SERVER_START_S = float(os.environ.get("VLM_CAPTION_TEST_SERVER_START_S", "300"))  # first uvx run downloads wheels


def operator_env(tmp_path: Path) -> dict[str, str]:
    """A shell with nothing Prefect set but its own PREFECT_HOME, as after a fresh clone."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PREFECT_API_URL", "PREFECT_UI_API_URL", "PREFECT_SERVER_EPHEMERAL"))}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "HF_HUB_OFFLINE": "1"})
    return env


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no output)"


def wait_for_health(api: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"`vlm-caption server` exited with {server.returncode} before {api}/health "
                        f"answered; its output:\n{tail(log)}")
        try:
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"`vlm-caption server` did not answer {api}/health within {SERVER_START_S:.0f} s "
                f"(VLM_CAPTION_TEST_SERVER_START_S); its output:\n{tail(log)}")


def stop(server: subprocess.Popen) -> None:
    """The server is uv, Prefect's CLI and uvicorn: its own session, stopped as a group."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def chromium() -> str | None:
    return next((found for name in ("chromium", "chromium-browser", "google-chrome")
                 if (found := shutil.which(name))), None)


def browse(browser: str, url: str, profile: Path, screenshot: Path | None = None) -> str:
    """The page's rendered DOM (after its scripts fetched from the API), or a screenshot of it."""
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={profile}", "--virtual-time-budget=15000", "--window-size=1400,1000"]
    args += [f"--screenshot={screenshot}", url] if screenshot else ["--dump-dom", url]
    done = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"chromium failed on {url}:\n{done.stderr[-3000:]}"
    return done.stdout


def page_text(dom: str) -> str:
    text = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", text)))


def shows(browser: str, url: str, profile: Path, *expected: str) -> str:
    """The page's text once it shows all of `expected` (a busy machine may need a second look)."""
    for _ in range(3):
        text = page_text(browse(browser, url, profile))
        if all(item in text for item in expected):
            return text
        time.sleep(5)
    missing = [item for item in expected if item not in text]
    pytest.fail(f"{url} does not show {missing}; it shows:\n{text[:3000]}")


def alnum(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z]", "", text)


@pytest.mark.timeout(1800)
def test_an_operator_starts_the_server_runs_the_demo_and_sees_it_in_the_ui(tmp_path):
    port = free_port()
    ui, api = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api"
    env = operator_env(tmp_path)
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([str(EXE), "server", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                  env=env, start_new_session=True)
    try:
        wait_for_health(api, server, log)
        printed = log.read_text()
        assert f"UI:  {ui}" in printed and f"export PREFECT_API_URL={api}" in printed, printed[:2000]

        demo_dir = tmp_path / "demo"
        # In a terminal, as a person runs it: a progress bar and a summary; the rest in the log file.
        code, screen = run_in_a_terminal([str(EXE), "demo", "--dir", str(demo_dir), "--images", "3"],
                                         env={**env, "PREFECT_API_URL": api}, timeout=1200)
        assert code == 0, screen[-4000:]
        assert_quiet_terminal(screen, demo_dir / "captions", items=3)

        # What the operator will look for, from the API: the run, its artifacts, its logs.
        runs = httpx.post(f"{api}/flow_runs/filter", json={"flows": {"name": {"any_": ["vlm-caption"]}}},
                          timeout=30).json()
        assert len(runs) == 1, runs
        run = runs[0]
        run_name = f"llava · {demo_dir / 'images'}"
        assert run["name"] == run_name and run["state"]["type"] == "COMPLETED", run
        artifacts = {a["key"]: a for a in httpx.post(
            f"{api}/artifacts/filter", json={"flow_runs": {"id": {"any_": [run["id"]]}}}, timeout=30).json()}
        assert {"vlm-caption-summary", "vlm-caption-samples", "vlm-caption-progress"} <= set(artifacts)
        summary = {row["metric"]: row["value"] for row in json.loads(artifacts["vlm-caption-summary"]["data"])}
        assert summary["succeeded"] == "3" and summary["failed"] == "0"
        records = result_records(demo_dir / "captions")
        captions = {r["key"]: r["text"] for r in records}
        assert sorted(captions) == ["sample-00.jpg", "sample-01.png", "sample-02.webp"]
        logs = httpx.post(f"{api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [run["id"]]}}},
                          timeout=30).json()
        ours = [entry["message"] for entry in logs if entry["name"] == "vlm_caption"]
        assert any(m.startswith("batch done batch=1 first_shard=0 last_shard=0 shards=1 items=3") for m in ours), ours
        assert not any(m.lstrip().startswith("{") for m in ours), ours  # no JSON strings in the UI

        browser = chromium()
        if browser is None:
            if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
                pytest.fail("CI=true but chromium is not installed (.ci/run installs it with apt-get)")
            pytest.skip("the server, the demo run and the API checked out; the browser part needs chromium "
                        "(apt-get install chromium), which is not installed, and this is not CI")

        # The UI an operator opens: the server's root sends the browser to the default UI.
        root = httpx.get(f"{ui}/", headers={"Accept": "text/html"}, timeout=30)
        base = root.headers["location"].rstrip("/") if root.is_redirect else ""
        base = base.removeprefix(ui)
        profile = tmp_path / "chromium-profile"
        run_page = f"{ui}{base}/runs/flow-run/{run['id']}"
        # (The log tab shows the first page of lines; the run's last lines may be below it.)
        text = shows(browser, run_page, profile, run_name, "Completed", "engine ready model=",
                     "batch done batch=1 first_shard=0 last_shard=0 shards=1 items=3")
        assert '"event":' not in text  # the log tab reads `event key=value`, not JSON
        shows(browser, f"{run_page}?tab=Artifacts", profile, "vlm-caption-summary", "vlm-caption-samples")
        table = shows(browser, f"{ui}{base}/artifacts/artifact/{artifacts['vlm-caption-summary']['id']}", profile,
                      "vlm-caption run summary", "processed 3", "succeeded 3", "failed 0")
        assert run_name in table  # the artifact links back to its run
        samples_page = f"{ui}{base}/artifacts/artifact/{artifacts['vlm-caption-samples']['id']}"
        samples = shows(browser, samples_page, profile, "A few captions from this run", *captions)
        # Random-weight captions are noise (odd symbols the markdown may render its way): compared
        # on their letters and digits.
        assert all(alnum(caption) in alnum(samples) for caption in captions.values()), (captions, samples[:3000])

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shots = {"flow-run.png": run_page, "samples.png": samples_page}
        for name, url in shots.items():
            browse(browser, url, profile, screenshot=ARTIFACTS / name)
            assert (ARTIFACTS / name).stat().st_size > 10_000, f"{name}: an empty screenshot"
            print(f"screenshot of {url}: {ARTIFACTS / name}")
    finally:
        stop(server)


@pytest.mark.timeout(600)
def test_ctrl_c_stops_the_server_in_two_lines_with_a_client_attached(tmp_path):
    """Ctrl-C at the server's terminal (SIGINT to its process group) while a client holds its event
    stream open, as a worker or the UI does: two lines, not uvicorn's and Prefect's services'
    tracebacks for each open connection (some 200 lines), and the server's processes gone."""
    from websockets.sync.client import connect

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([str(EXE), "server", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                  env=operator_env(tmp_path), start_new_session=True)
    try:
        wait_for_health(api, server, log)
        with connect(f"ws://127.0.0.1:{port}/api/events/out") as stream:
            stream.send(json.dumps({"type": "filter", "filter": {}}))
            time.sleep(1)
            printed = len(log.read_text())
            os.killpg(server.pid, signal.SIGINT)
            code = server.wait(timeout=120)
        after = [line for line in log.read_text()[printed:].splitlines() if line.strip()]
        assert after == ["vlm-caption server: stopping ...", "vlm-caption server: stopped"], after
        assert code == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{api}/health", timeout=2)
    finally:
        stop(server)


def test_the_server_refuses_a_port_in_use_in_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["server", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == (f"vlm-caption: error: port {port} on 127.0.0.1 is in use (another Prefect server?): "
                   "stop it or pass --port\n")


def test_the_server_without_uv_says_how_to_get_it(monkeypatch, capsys):
    import vlm_caption.flows.server as _loaded  # noqa: F401 - binds no name `vlm_caption` (the flow has it)
    from vlm_caption import flows
    monkeypatch.setattr(flows.server.shutil, "which", lambda name: None)
    assert cli.main(["server", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vlm-caption: error: ") and "uv" in err and "pip install uv" in err
    assert err.count("\n") == 1


def test_the_server_runs_prefect_at_the_projects_version_in_its_own_environment(monkeypatch, capsys, tmp_path):
    from importlib.metadata import version

    import vlm_caption.flows.server as _loaded  # noqa: F401 - binds no name `vlm_caption` (the flow has it)

    import prefect.settings  # noqa: F401 - Prefect's settings read now, not under the environment below: imported
    # under it (serve may import Prefect), Prefect would keep its API URL for the tests after this one

    from vlm_caption import flows
    monkeypatch.setenv("PREFECT_API_URL", "http://elsewhere:4200/api")
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("vlm_caption.tasks.prefect_api.show_prefect_notice_now", lambda file, import_now=False: None)
    started = {}

    class Ended:  # a server that printed a line and ended
        stdout = io.BytesIO(b"Server stopped!\n")

        def wait(self, timeout=None):
            return 0

    def start(argv, env, **streams):
        started.update(argv=argv, env=env)
        return Ended()

    port = free_port()
    code = flows.server.serve("127.0.0.1", port, start=start)
    assert code == 0
    argv, env = started["argv"], started["env"]
    assert f"prefect=={version('prefect')}" in argv and flows.server.SERVER_FASTAPI in argv
    assert f"sqlalchemy=={version('sqlalchemy')}" in argv  # SQLAlchemy 2.1 breaks Prefect 3.8's scheduler
    assert argv[-7:] == ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    assert "PREFECT_API_URL" not in env and env["PREFECT_HOME"] == str(tmp_path / "home")
    assert env["PREFECT_UI_API_URL"] == f"http://127.0.0.1:{port}/api"
    out = capsys.readouterr().out
    assert f"UI:  http://127.0.0.1:{port}" in out and f"export PREFECT_API_URL=http://127.0.0.1:{port}/api" in out


@pytest.mark.timeout(300)
def test_a_run_whose_prefect_api_is_unreachable_says_what_to_do_before_any_engine_starts(tmp_path, tiny_llava):
    from vlm_caption.flows.demo import make_sample_images

    make_sample_images(tmp_path / "images", 2)
    api = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    started = time.monotonic()
    done = subprocess.run([str(EXE), "run", str(tmp_path / "images"), "--out", str(tmp_path / "out"),
                           "--model", str(tiny_llava)], capture_output=True, text=True, timeout=240,
                          env={**operator_env(tmp_path), "PREFECT_API_URL": api})
    assert done.returncode == 3, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vlm-caption: error: cannot reach the Prefect API at {api}")
    assert "`vlm-caption server`" in lines[0] and "unset PREFECT_API_URL" in lines[0]
    assert time.monotonic() - started < 120  # no engine was started (a CPU engine alone takes longer)
    assert not (tmp_path / "out").exists()


def test_a_line_logged_before_prefect_is_imported_imports_none_of_it_and_later_lines_reach_the_ui():
    """The engine's thread logs where the processor goes before `vllm.LLM` starts, while the
    flow's thread has not imported Prefect yet: that line goes to stderr without importing
    Prefect's logging (a second of imports before the engine's start), and the first line after
    Prefect is imported adds the handler that sends lines to the flow run's logs."""
    code = """
import logging, sys
from vlm_caption.tasks.observability import LOGGER_NAME, get_logger
get_logger().info("model processor placed", device="cuda")
print("prefect imported:", "prefect" in sys.modules, [type(h).__name__ for h in logging.getLogger(LOGGER_NAME).handlers])
import prefect
get_logger().info("run started")
get_logger().info("run finished")
print("then:", [type(h).__name__ for h in logging.getLogger(LOGGER_NAME).handlers])
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["prefect imported: False ['StreamHandler']",
                                        "then: ['StreamHandler', 'APILogHandler']"]
    assert [json.loads(line)["event"] for line in done.stderr.splitlines()] == [
        "model processor placed", "run started", "run finished"]


def test_log_lines_read_as_event_key_value_in_the_ui_and_stay_json_for_machines():
    import structlog
    from prefect.logging.handlers import APILogHandler

    from vlm_caption.tasks.observability import LOGGER_NAME, _Formatter, get_logger, register_secret

    secret = "vlm-caption-test-secret-5e0c1d"
    register_secret(secret)
    log = get_logger(run_id="r-1", fingerprint="f00d")
    ui_handler = next(h for h in logging.getLogger(LOGGER_NAME).handlers if isinstance(h, APILogHandler))

    class Keep(logging.Handler):
        def __init__(self, formatter):
            super().__init__()
            self.setFormatter(formatter)
            self.lines = []

        def emit(self, record):
            self.lines.append(self.format(record))

    people, machines = Keep(ui_handler.formatter), Keep(_Formatter(structlog.processors.JSONRenderer()))
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(people)
    logger.addHandler(machines)
    try:
        log.info("taking the job's slot", limit="vlm-caption-job-f00d", wait_s=21600.0, note="two words",
                 token=f"Bearer {secret}")
    finally:
        logger.removeHandler(people)
        logger.removeHandler(machines)
    assert people.lines == ["taking the job's slot limit=vlm-caption-job-f00d wait_s=21600.0 "
                            'note="two words" token="Bearer ***" run_id=r-1 fingerprint=f00d']
    record = json.loads(machines.lines[0])
    assert record["event"] == "taking the job's slot" and record["fingerprint"] == "f00d"
    assert record["token"] == "Bearer ***" and record["level"] == "info" and "timestamp" in record
