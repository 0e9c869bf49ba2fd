"""The deployments as a user runs them: a real `prefect server`, the real CLI, two real workers.

`prefect server start` (SQLite) on loopback, the GPU work pool from our base job template,
`prefect deploy --all`, the zombie automation, an AwsCredentials block pointing at moto's S3
server, and two process workers (`--limit 1`, CUDA_VISIBLE_DEVICES 0 and 1). Then
`prefect deployment run vlm-caption/prod` with the tiny checkpoint, checked through the
Prefect REST API and the bucket; and a worker killed mid-run, then the deployment run again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import httpx
import pytest

from tests.conftest import free_port
from tests.images import image_bytes

REPO = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect"]
BUCKET = "nightly"
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
pytestmark = pytest.mark.timeout(1500)  # a hung worker must fail the test, not stall CI


class PrefectStack:
    """A Prefect server plus workers as subprocesses, driven through the CLI and the REST API."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = {key: value for key, value in os.environ.items()
                    if not key.startswith(("AWS_", "PREFECT_", "VLM_CAPTION_"))}  # storage creds: the block only
        self.env.update({
            "PREFECT_API_URL": self.api, "PREFECT_HOME": str(root / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_CLI_PROMPT": "false",
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
        db = self.root / "prefect.db"
        self.server = self._spawn("server", [*PREFECT, "server", "start", "--host", "127.0.0.1",
                                             "--port", str(self.port)],
                                  PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{db}",
                                  # SQLite waits this long for a lock (10 s by default): two workers,
                                  # their flow runs and the CLI write at once on a busy 2-core machine
                                  PREFECT_SERVER_DATABASE_TIMEOUT="60",
                                  # a dead run's deployment concurrency slot is freed after 30 s, not 5 min
                                  PREFECT_SERVER_CONCURRENCY_INITIAL_DEPLOYMENT_LEASE_DURATION="30")
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.server.poll() is None, (self.root / "server.log").read_text()[-3000:]
            time.sleep(1)
        raise TimeoutError("prefect server did not become healthy")

    def start_worker(self, name: str, gpu: str) -> None:
        self.workers[name] = self._spawn(
            f"worker-{name}", [*PREFECT, "worker", "start", "--pool", "vlm-caption-gpu", "--limit", "1",
                               "--name", name, "--type", "process"], CUDA_VISIBLE_DEVICES=gpu)

    def kill_worker(self, name: str) -> None:
        """SIGKILL a worker with everything under it (flow run, vLLM engine): a host that died."""
        _kill_tree(self.workers[name].pid, signal.SIGKILL)
        self.workers.pop(name).wait(timeout=30)

    def close(self) -> None:
        for proc in [*self.workers.values(), self.server]:
            if proc is not None and proc.poll() is None:
                _kill_tree(proc.pid, signal.SIGTERM)
        for proc in [*self.workers.values(), self.server]:
            if proc is not None:
                try:
                    proc.wait(timeout=20)
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
        """The test's reads of the API, retried on a server error ("database is locked" under
        load is the server's transient trouble, not what these tests check)."""
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


@pytest.fixture(scope="module")
def stack(tmp_path_factory, s3_endpoint, tiny_llava):
    import boto3

    root = tmp_path_factory.mktemp("deployments")
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=BUCKET)
    stack = PrefectStack(root)
    try:
        stack.start_server()
        # What the README's "Operate it" says, in order.
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


def job_for(prefix: str, model: Path, **extra) -> dict:
    return {"source": f"s3://{BUCKET}/{prefix}/", "output": f"s3://{BUCKET}/captions/", "recipe": "llava",
            "model": str(model), "fan_out": 2, "shard_size": 2, "sampling": {"max_tokens": 8},
            "engine_overrides": {"kv_cache_memory_bytes": 512 * 1024**2}, **extra}


def upload(s3_client, prefix: str, count: int) -> set[str]:
    keys = set()
    for i in range(count):
        key = f"{prefix}/{prefix}-{i:03d}.jpg"
        s3_client.put_object(Bucket=BUCKET, Key=key, Body=image_bytes(size=(64 + i, 48), color=(i * 5 % 255, 80, 160)))
        keys.add(key.split("/", 1)[1])
    return keys


def records_under(s3_client, prefix: str) -> list[dict]:
    records = []
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    for page in pages:
        for obj in page.get("Contents", []):
            if obj["Key"].endswith(".jsonl"):
                body = s3_client.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read().decode()
                records += [json.loads(line) for line in body.splitlines() if line.strip()]
    return records


def manifests(s3_client) -> dict[str, dict]:
    found = s3_client.list_objects_v2(Bucket=BUCKET, Prefix="captions/manifests/").get("Contents", [])
    return {obj["Key"]: json.loads(s3_client.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read())
            for obj in found}


def test_prod_deployment_fans_out_over_two_workers(stack, s3_client, tiny_llava):
    keys = upload(s3_client, "images", 12)
    s3_client.put_object(Bucket=BUCKET, Key="images/broken.jpg", Body=b"\xff\xd8 not a jpeg")
    keys.add("broken.jpg")

    deployment = stack.get("/deployments/name/vlm-caption/prod")
    schedule = deployment["schedules"][0]["schedule"]
    assert (schedule["cron"], schedule["timezone"]) == ("0 2 * * *", "Europe/Berlin")
    assert deployment["global_concurrency_limit"]["limit"] == 1  # nightly runs never overlap
    assert deployment["concurrency_options"]["collision_strategy"] == "ENQUEUE"
    assert deployment["work_pool_name"] == "vlm-caption-gpu"
    assert deployment["parameters"]["job"]["source"] == f"s3://{BUCKET}/images/"  # from the variable

    parent_id = stack.run_deployment("vlm-caption/prod", job_for("images", tiny_llava))
    parent = stack.wait_for(parent_id)
    assert parent["state_type"] == "COMPLETED", (stack.root / "worker-gpu0.log").read_text()[-4000:]
    children = [run for run in stack.runs_of("vlm-caption/partition")]
    assert [child["state_type"] for child in children] == ["COMPLETED"]

    records = records_under(s3_client, "captions/results/")
    assert Counter(r["key"] for r in records) == Counter(keys)  # every object once, none twice
    assert {r["key"] for r in records if r["error"]} == {"broken.jpg"}
    run_ids = {r["run_id"].rsplit("-", 1)[1] for r in records}
    assert run_ids == {"p0", "p1"}  # both partitions captioned something

    (manifest,) = manifests(s3_client).values()  # one manifest for the whole fanned-out run
    assert manifest["counts"]["processed"] == 13 and manifest["counts"]["failed"] == 1
    workers = {p["worker"]: p["devices"] for p in manifest["partitions"]}
    assert workers == {"gpu0": "0", "gpu1": "1"}  # the two partitions ran on the two workers
    assert {p["state"] for p in manifest["partitions"]} == {"COMPLETED"}
    assert {"vlm-caption-summary", "vlm-caption-progress"} <= stack.artifacts_of(parent_id)

    # The server's scheduler has put the coming nights on the calendar: 02:00 in Berlin.
    nightly = [run for run in stack.runs_of("vlm-caption/prod") if run["state_type"] == "SCHEDULED"]
    assert nightly, "the server scheduled no nightly runs"
    for run in nightly:
        start = datetime.fromisoformat(run["expected_start_time"]).astimezone(ZoneInfo("Europe/Berlin"))
        assert (start.hour, start.minute) == (2, 0)


def test_rerun_after_a_worker_dies_completes_without_duplicates(stack, s3_client, tiny_llava):
    keys = upload(s3_client, "more", 40)
    job = job_for("more", tiny_llava, shard_size=1)
    first_id = stack.run_deployment("vlm-caption/prod", job)

    # Wait until the parent run has captioned something of its own partition, then kill its worker.
    deadline = time.time() + 600
    while time.time() < deadline:
        first = stack.flow_run(first_id)
        done = [r for r in records_under(s3_client, "captions/results/") if r["key"] in keys]
        if first["state_type"] == "RUNNING" and any(r["run_id"].endswith("-p0") for r in done):
            break
        assert first["state_type"] not in FINAL, "the run ended before the worker could be killed"
        time.sleep(0.5)
    flow_pid = int(first["infrastructure_pid"].rsplit(":", 1)[-1])  # "pid" or "host:pid"
    worker = next(name for name, proc in stack.workers.items() if flow_pid in _descendants(proc.pid))
    stack.kill_worker(worker)
    partial = {r["key"] for r in records_under(s3_client, "captions/results/") if r["key"] in keys}
    assert partial < keys  # killed mid-run: some of the job is left

    # The orphaned child keeps going on the other worker; a replacement worker comes up and the
    # deployment runs again at once (it waits for the dead run's concurrency slot and the orphan).
    (orphan,) = [run for run in stack.runs_of("vlm-caption/partition") if run["state_type"] not in FINAL]
    stack.start_worker(f"{worker}-replacement", "0" if worker == "gpu0" else "1")
    rerun_id = stack.run_deployment("vlm-caption/prod", job)
    rerun = stack.wait_for(rerun_id)
    assert rerun["state_type"] == "COMPLETED", (stack.root / "server.log").read_text()[-3000:]
    assert stack.flow_run(orphan["id"])["state_type"] == "COMPLETED"

    records = [r for r in records_under(s3_client, "captions/results/") if r["key"] in keys]
    assert Counter(r["key"] for r in records) == Counter(keys)  # all done, nothing twice
    rerun_manifest = next(m for m in manifests(s3_client).values() if m["run_id"].startswith(rerun_id[:8]))
    assert rerun_manifest["counts"]["skipped_already_done"] >= len(partial)
    assert rerun_manifest["counts"]["processed"] == len(keys) - rerun_manifest["counts"]["skipped_already_done"]


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


def test_dev_deployment_runs_video_from_its_form(stack, s3_client, checkpoints_root):
    """Another modality through `prefect deployment run vlm-caption/dev`: the parameters a user
    types into the deployment's form reach the flow (video, frames, two questions)."""
    from tests.checkpoints import build_checkpoint
    from tests.images import video_bytes

    model = build_checkpoint("qwen2_vl", checkpoints_root)
    for i in range(2):
        s3_client.put_object(Bucket=BUCKET, Key=f"clips/c{i}.mp4", Body=video_bytes(frames=16, seed=i))
    job = {"source": f"s3://{BUCKET}/clips/", "output": f"s3://{BUCKET}/dev-video/", "recipe": "qwen2_vl",
           "modality": "video", "num_frames": 4, "questions": ["What happens?", "Which colours?"],
           "model": str(model), "sampling": {"max_tokens": 4},
           "engine_overrides": {"kv_cache_memory_bytes": 512 * 1024**2}}
    run = stack.wait_for(stack.run_deployment("vlm-caption/dev", job))
    logs = "\n".join((stack.root / f"worker-{name}.log").read_text()[-3000:] for name in stack.workers)
    assert run["state_type"] == "COMPLETED", logs
    records = records_under(s3_client, "dev-video/results/")
    assert Counter((r["key"], r["question"]) for r in records) == Counter(
        {(f"c{i}.mp4", q): 1 for i in range(2) for q in job["questions"]})
    assert all(r["error"] is None and r["video"]["frames"] == 4 for r in records)
