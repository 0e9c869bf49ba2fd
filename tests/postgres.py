"""Session fixtures: one real PostgreSQL and one `prefect server start` on it, with the
deployments, the blocks, the automation and two process workers, shared by the deployment
tests (tests/test_deployments.py) and the API outage test (tests/test_api_outage.py), which runs
last of them: it stops the server and starts it again on the same database (`stop_server`, `start_server`).

PostgreSQL is Debian's (`apt-get install postgresql`, which `.ci/run` does), started with plain
`initdb`/`pg_ctl` in a temporary folder on a free port. PostgreSQL refuses to run as root, so as
root its commands run as the `postgres` user the package creates. SQLite stays the embedded
default, which the other tests use.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from vlm_caption.flows.server import LEASES_ON_DISK
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
VLM_CAPTION = str(Path(sys.executable).with_name("vlm-caption"))
BUCKET = "nightly"
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


# -- PostgreSQL ---------------------------------------------------------------------------------
def pg_bin(name: str) -> str | None:
    """A PostgreSQL program: on PATH, else in Debian's versioned folder (not on PATH by default)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                        key=lambda path: int(Path(path).parts[4]) if Path(path).parts[4].isdigit() else 0)
    return candidates[-1] if candidates else None


class PostgresServer:
    """A throwaway cluster: trust auth on loopback, no fsync (a test database, not a durable one)."""

    def __init__(self):
        self.port = free_port()
        # Not under pytest's tmp folders: those are 0700 root's, and the server runs as `postgres`.
        self.root = Path(tempfile.mkdtemp(prefix="vlm-caption-pg-"))
        self.data = self.root / "data"
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.root, "postgres")
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/prefect"

    def _run(self, *args: str) -> None:
        done = subprocess.run([*self.as_user, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"

    def start(self) -> None:
        self._run(pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.root / "postgres.log"),
                  "-w", "-t", "60", "start")
        self._run(pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "prefect")

    def stop(self) -> None:
        subprocess.run([*self.as_user, pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres():
    """A running PostgreSQL for the session; its `url` is an async SQLAlchemy URL for Prefect."""
    if not (pg_bin("initdb") and pg_bin("pg_ctl")):
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI=true but PostgreSQL is not installed (.ci/run installs it with apt-get)")
        pytest.skip("the deployment tests run Prefect on PostgreSQL: apt-get install postgresql")
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()


# -- Prefect server and workers -----------------------------------------------------------------
class PrefectStack:
    """A Prefect server plus workers as subprocesses, driven through the CLI and the REST API."""

    def __init__(self, root: Path, database: PostgresServer):
        self.root, self.database = root, database
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = {key: value for key, value in os.environ.items()
                    if not key.startswith(("AWS_", "PREFECT_", "VLM_CAPTION_"))}  # storage creds: the block only
        self.env.update({
            "PREFECT_API_URL": self.api, "PREFECT_HOME": str(root / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_CLI_PROMPT": "false",
            # Clients (CLI, workers, flow runs) give up on an unreachable API after ~15 s (2+4+8 s
            # between tries), not ~60 s, so the API outage test outlasts their retries with a 20 s
            # outage, well inside the zombie automation's 90 s.
            "PREFECT_CLIENT_MAX_RETRIES": "3",
            "VLM_CAPTION_HOME": str(REPO), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
        })
        self.workers: dict[str, subprocess.Popen] = {}
        self.logs: list = []
        self.server = None

    # -- processes --------------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], **env) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")
        self.logs.append(log)
        return subprocess.Popen(args, cwd=REPO, env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def start_server(self) -> None:
        """`vlm-caption server` (the README's: Prefect in its own environment, with the FastAPI it
        pins) on the stack's port and database (again after `stop_server`)."""
        self.server = self._spawn("server", [VLM_CAPTION, "server", "--host", "127.0.0.1", "--port", str(self.port)],
                                  PREFECT_SERVER_DATABASE_CONNECTION_URL=self.database.url,
                                  # leases survive the outage test's restart, as `vlm-caption server` sets
                                  PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=LEASES_ON_DISK,
                                  # a dead run's deployment concurrency slot is freed after 30 s, not 5 min
                                  PREFECT_SERVER_CONCURRENCY_INITIAL_DEPLOYMENT_LEASE_DURATION="30",
                                  # a run held back by the deployment's limit (the rerun after a
                                  # worker died) asks again every 5 s, not 30: it still waits for
                                  # the dead run's slot, but starts within 5 s of its release
                                  PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS="5",
                                  # and expired leases (the job's slot too) are looked for every 2 s, not 15
                                  PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS="2")
        deadline = time.time() + 300  # the first `uv tool run` on a fresh machine downloads Prefect
        while time.time() < deadline:
            if self.healthy():
                return
            assert self.server.poll() is None, (self.root / "server.log").read_text()[-3000:]
            time.sleep(1)
        raise TimeoutError("prefect server did not become healthy")

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.api}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop_server(self) -> None:
        """The API goes away (a restart, an upgrade): the server and its services stop."""
        _kill_tree(self.server.pid, signal.SIGTERM)
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _kill_tree(self.server.pid, signal.SIGKILL)
            self.server.wait(timeout=30)

    def start_worker(self, name: str, gpu: str) -> None:
        self.workers[name] = self._spawn(
            f"worker-{name}", [*PREFECT, "worker", "start", "--pool", "vlm-caption-gpu", "--limit", "1",
                               "--name", name, "--type", "process"], CUDA_VISIBLE_DEVICES=gpu)

    def kill_worker(self, name: str) -> None:
        """SIGKILL a worker with everything under it (flow run, vLLM engine): a host that died."""
        _kill_tree(self.workers[name].pid, signal.SIGKILL)
        self.workers.pop(name).wait(timeout=30)

    def signal_worker(self, name: str, sig: int) -> None:
        """Send `sig` to a worker and everything under it (SIGSTOP: a host frozen; SIGCONT: thawed)."""
        _kill_tree(self.workers[name].pid, sig)

    def close(self) -> None:
        for proc in [*self.workers.values(), self.server]:
            if proc is not None and proc.poll() is None:
                _kill_tree(proc.pid, signal.SIGTERM)
        for proc in [*self.workers.values(), self.server]:
            if proc is not None:
                try:
                    proc.wait(timeout=5)  # a test stack: no need for a graceful end
                except subprocess.TimeoutExpired:
                    _kill_tree(proc.pid, signal.SIGKILL)
        for log in self.logs:
            log.close()

    # -- CLI and API ------------------------------------------------------------------------
    def cli(self, *args: str, timeout: float = 300) -> str:
        done = subprocess.run([*PREFECT, *args], cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"prefect {' '.join(args)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def python(self, code: str) -> None:
        subprocess.run([sys.executable, "-c", code], cwd=REPO, env=self.env, check=True, timeout=120)

    def get(self, path: str):
        return self._request("GET", path)

    def post(self, path: str, body: dict):
        return self._request("POST", path, json=body)

    def _request(self, method: str, path: str, **kwargs):
        """The test's reads of the API, retried on a server error (the server's transient
        trouble under load is not what these tests check)."""
        for attempt in range(6):
            try:
                response = httpx.request(method, f"{self.api}{path}", timeout=60, **kwargs)
                if response.status_code < 500 or attempt == 5:
                    response.raise_for_status()
                    return response.json()
            except httpx.TransportError:
                if attempt == 5:
                    raise
            time.sleep(2 * (attempt + 1))

    def run_deployment(self, name: str, job: dict) -> str:
        import json
        import re

        out = self.cli("deployment", "run", name, "--params", json.dumps({"job": job}))
        return re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1)

    def flow_run(self, flow_run_id: str) -> dict:
        return self.get(f"/flow_runs/{flow_run_id}")

    def wait_for(self, flow_run_id: str, timeout: float = 900) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            run = self.flow_run(flow_run_id)
            if run["state_type"] in FINAL:
                return run
            time.sleep(3)
        raise TimeoutError(f"flow run {flow_run_id} still {run['state_type']}; logs in {self.root}")

    def runs_of(self, deployment: str) -> list[dict]:
        deployment_id = self.get(f"/deployments/name/{deployment}")["id"]
        return self.post("/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment_id]}}})

    def artifacts_of(self, flow_run_id: str) -> set[str]:
        found = self.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
        return {artifact["key"] for artifact in found if artifact["key"]}

    def log_tail(self, *names: str, chars: int = 3000) -> str:
        return "\n".join(f"--- {name}.log\n" + (self.root / f"{name}.log").read_text(errors="replace")[-chars:]
                         for name in names if (self.root / f"{name}.log").exists())


@pytest.fixture(scope="session")
def prefect_stack(tmp_path_factory, postgres, s3_endpoint, tiny_llava):
    """The deployments as a user sets them up (docs/operations.md, in order), on PostgreSQL,
    with two process workers (CUDA_VISIBLE_DEVICES 0 and 1)."""
    import boto3

    root = tmp_path_factory.mktemp("deployments")
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=BUCKET)
    stack = PrefectStack(root, postgres)
    try:
        stack.start_server()
        stack.cli("work-pool", "create", "vlm-caption-gpu", "--type", "process",
                  "--base-job-template", "deployments/base-job-templates/process-gpu.json")
        stack.python(
            "from prefect_aws import AwsCredentials\n"
            "AwsCredentials(aws_access_key_id='testing', aws_secret_access_key='testing', region_name='us-east-1',"
            f" aws_client_parameters={{'endpoint_url': '{s3_endpoint}'}}).save('vlm-caption-s3')")
        stack.cli("variable", "set", "vlm_caption_source", f"s3://{BUCKET}/images/")
        stack.cli("variable", "set", "vlm_caption_output", f"s3://{BUCKET}/captions/")
        stack.cli("variable", "set", "vlm_caption_dev_output", f"s3://{BUCKET}/dev-captions/")
        stack.cli("deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
        stack.cli("automation", "create", "--from-file", "deployments/automations.yaml")
        stack.start_worker("gpu0", "0")
        stack.start_worker("gpu1", "1")
        yield stack
    finally:
        stack.close()


def uses_the_stack(item) -> bool:
    return "prefect_stack" in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    """The stack lives for its tests only. They run together (one unit of the xdist schedule,
    tests/conftest.py) with the outage test last; after the last of them its server, workers and
    PostgreSQL stop, while this xdist worker goes on with other tests on a small CI machine."""
    if uses_the_stack(item) and (nextitem is None or not uses_the_stack(nextitem)):
        stack = item.funcargs.get("prefect_stack")
        if stack is not None:
            stack.close()
            stack.database.stop()


def _descendants(root: int) -> set[int]:
    """`root` and every process under it (the flow run's process starts its own session)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def _kill_tree(root: int, sig: int) -> None:
    for pid in _descendants(root):  # listed first, so nothing is re-parented to init unseen
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
