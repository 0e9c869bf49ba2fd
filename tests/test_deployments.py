"""The deployments as a user runs them: a real `prefect server`, the real CLI, two real workers.

`prefect server start` on PostgreSQL (the session's, tests/postgres.py) on loopback, the GPU
work pool from our base job template, `prefect deploy --all`, the zombie automation, an
AwsCredentials block pointing at moto's S3 server, and two process workers (`--limit 1`, CUDA_VISIBLE_DEVICES 0 and 1). Then
`prefect deployment run vlm-caption/prod` with the tiny checkpoint, checked through the
Prefect REST API and the bucket; and a worker killed mid-run, then the deployment run again.
The README's "Operate it" block itself, as typed: tests/test_readme_operate.py.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from tests.images import image_bytes
from tests.postgres import BUCKET, FINAL, _descendants
from tests.result_files import s3_records

pytestmark = pytest.mark.timeout(1500)  # a hung worker must fail the test, not stall CI


@pytest.fixture
def stack(prefect_stack):
    """The session's one Prefect server on PostgreSQL with its two workers (tests/postgres.py)."""
    return prefect_stack


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


def records_under(s3_client, out: str) -> list[dict]:
    """The records of the output `s3://BUCKET/out`: its view files and the parts not folded yet."""
    return s3_records(s3_client, BUCKET, out)


def manifests(s3_client) -> dict[str, dict]:
    found = s3_client.list_objects_v2(Bucket=BUCKET, Prefix="captions/manifests/").get("Contents", [])
    return {obj["Key"]: json.loads(s3_client.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read())
            for obj in found if obj["Key"].endswith(".json")}  # the run's gallery (.html) sits beside it


def test_prod_deployment_fans_out_over_two_workers(stack, s3_client, tiny_llava):
    keys = upload(s3_client, "images", 12)
    s3_client.put_object(Bucket=BUCKET, Key="images/broken.jpg", Body=b"\xff\xd8 not a jpeg")
    keys.add("broken.jpg")

    # The README's "Operate it" path against `vlm-caption server`: `prefect deploy --all` made all
    # three (the fixture ran it; a 422 there stopped it after the first), and the CLI lists them.
    listed = stack.cli("deployment", "ls")
    for name in ("prod", "partition", "dev"):
        assert stack.get(f"/deployments/name/vlm-caption/{name}")["name"] == name
        assert f"vlm-caption/{name}" in listed, listed
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

    records = records_under(s3_client, "captions/")
    assert Counter(r["key"] for r in records) == Counter(keys)  # every object once, none twice
    assert {r["key"] for r in records if r["error"]} == {"broken.jpg"}
    # The partitions shared the 7 shards by claims: each shard once (a child that starts late,
    # here after the parent claimed the whole feed while its engine started, may get none).
    run_ids = {r["run_id"].rsplit("-", 1)[1] for r in records}
    assert run_ids <= {"p0", "p1"}

    (manifest,) = manifests(s3_client).values()  # one manifest for the whole fanned-out run
    assert manifest["counts"]["processed"] == 13 and manifest["counts"]["failed"] == 1
    workers = {p["worker"]: p["devices"] for p in manifest["partitions"]}
    assert workers == {"gpu0": "0", "gpu1": "1"}  # the two partitions ran on the two workers
    # how many cores each partition's process could use: the workers are started from this one
    assert {p["cpus"] for p in manifest["partitions"]} == {str(len(os.sched_getaffinity(0)))}
    assert {p["state"] for p in manifest["partitions"]} == {"COMPLETED"}
    assert sum(p["shards"] for p in manifest["partitions"]) == 7  # 13 objects in shards of 2
    assert all(p["engine_ready_at"] for p in manifest["partitions"] if p["shards"])
    # How each partition's start split: asked for, its worker's process began, vllm.LLM began, ready.
    for p in (p for p in manifest["partitions"] if p["shards"]):
        began = p["engine_ready_at"] - p["engine_build_s"]
        assert p["asked_at"] - 0.5 <= p["process_started_at"] < began < p["engine_ready_at"], p
    # The Parquet export finds the source of the partitions' rows in the run's one manifest.
    assert not [run for run in manifest["parquet"].get("runs_without_source", {})
                if run.startswith(manifest["run_id"])], manifest["parquet"]
    assert {"vlm-caption-summary", "vlm-caption-progress"} <= stack.artifacts_of(parent_id)

    # The server's scheduler has put the coming nights on the calendar: 02:00 in Berlin.
    nightly = [run for run in stack.runs_of("vlm-caption/prod") if run["state_type"] == "SCHEDULED"]
    assert nightly, "the server scheduled no nightly runs"
    for run in nightly:
        start = datetime.fromisoformat(run["expected_start_time"]).astimezone(ZoneInfo("Europe/Berlin"))
        assert (start.hour, start.minute) == (2, 0)


def test_rerun_after_a_worker_dies_completes_without_duplicates(stack, s3_client, tiny_llava):
    keys = upload(s3_client, "more", 40)
    # One sequence at a time, 160 tokens each, so the run is still going when its first part shows
    # (the parent claims the feed's worth of shards at once; a 40-way batch of 8 tokens ended in
    # one step, and 16 tokens one at a time in 4 s, on an idle machine).
    job = job_for("more", tiny_llava, shard_size=1, sampling={"max_tokens": 160, "ignore_eos": True},
                  engine_overrides={"kv_cache_memory_bytes": 512 * 1024**2, "max_num_seqs": 1})
    first_id = stack.run_deployment("vlm-caption/prod", job)

    # Wait until the parent run has captioned something of its own partition, then kill its worker.
    deadline = time.time() + 600
    while time.time() < deadline:
        first = stack.flow_run(first_id)
        done = [r for r in records_under(s3_client, "captions/") if r["key"] in keys]
        if first["state_type"] == "RUNNING" and any(r["run_id"].endswith("-p0") for r in done):
            break
        assert first["state_type"] not in FINAL, "the run ended before the worker could be killed"
        time.sleep(0.5)
    flow_pid = int(first["infrastructure_pid"].rsplit(":", 1)[-1])  # "pid" or "host:pid"
    worker = next(name for name, proc in stack.workers.items() if flow_pid in _descendants(proc.pid))
    stack.kill_worker(worker)
    partial = {r["key"] for r in records_under(s3_client, "captions/") if r["key"] in keys}
    assert partial < keys  # killed mid-run: some of the job is left

    # The orphaned child keeps going on the other worker; a replacement worker comes up and the
    # deployment runs again at once (it waits for the dead run's concurrency slot and the orphan).
    (orphan,) = [run for run in stack.runs_of("vlm-caption/partition") if run["state_type"] not in FINAL]
    stack.start_worker(f"{worker}-replacement", "0" if worker == "gpu0" else "1")
    rerun_id = stack.run_deployment("vlm-caption/prod", job)
    rerun = stack.wait_for(rerun_id)
    assert rerun["state_type"] == "COMPLETED", (stack.root / "server.log").read_text()[-3000:]
    assert stack.flow_run(orphan["id"])["state_type"] == "COMPLETED"

    records = [r for r in records_under(s3_client, "captions/") if r["key"] in keys]
    assert Counter(r["key"] for r in records) == Counter(keys)  # all done, nothing twice
    # The orphan finished the killed parent's claimed shards itself (their heartbeat went still).
    reports = s3_client.list_objects_v2(Bucket=BUCKET, Prefix=f"captions/partitions/{first_id[:8]}")["Contents"]
    (orphan_report,) = [json.loads(s3_client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read())
                        for o in reports]
    assert orphan_report["retaken"] > 0 and orphan_report["shards"] >= orphan_report["retaken"]
    rerun_manifest = next(m for m in manifests(s3_client).values() if m["run_id"].startswith(rerun_id[:8]))
    assert rerun_manifest["counts"]["skipped_already_done"] >= len(partial)
    assert rerun_manifest["counts"]["processed"] == len(keys) - rerun_manifest["counts"]["skipped_already_done"]


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
    records = records_under(s3_client, "dev-video/")
    assert Counter((r["key"], r["question"]) for r in records) == Counter(
        {(f"c{i}.mp4", q): 1 for i in range(2) for q in job["questions"]})
    assert all(r["error"] is None and r["video"]["frames"] == 4 for r in records)


def test_a_permanent_error_fails_a_deployment_run_at_once(stack, tmp_path):
    """prod retries a failed run after 300 s; a model that is not there is not retried: the run is
    Failed on its first attempt, its message one line, its name the job's."""
    (tmp_path / "photos").mkdir()
    job = {"source": str(tmp_path / "photos"), "output": str(tmp_path / "out"), "recipe": "llava",
           "model": str(tmp_path / "no-such-model")}
    started = time.monotonic()
    run = stack.wait_for(stack.run_deployment("vlm-caption/prod", job), timeout=300)
    print(f"permanent error: final after {time.monotonic() - started:.1f} s")
    states = [s["name"] for s in stack.get(f"/flow_run_states/?flow_run_id={run['id']}")]
    assert run["state_type"] == "FAILED" and run["run_count"] == 1, (run["state"], states)
    assert "AwaitingRetry" not in states, states
    message = run["state"]["message"]
    assert message.startswith(f"model folder {tmp_path / 'no-such-model'} does not exist"), message
    assert "\n" not in message and "Traceback" not in message
    assert run["name"] == f"llava · {tmp_path / 'photos'}"


def test_a_run_whose_parameters_do_not_validate_is_named_and_fails_once(stack, tmp_path):
    job = {"source": str(tmp_path), "output": "", "recipe": "llava"}  # an empty output (a variable not set)
    run_id = stack.run_deployment("vlm-caption/dev", job)
    run = stack.wait_for(run_id, timeout=300)
    # Prefect ends the run Failed with pydantic's message, then the run's on_failure hook gives it
    # the readable one (and its name): what the UI shows once the hook has run, a moment later.
    deadline = time.time() + 60
    while not (run["state"]["message"] or "").startswith("invalid job") and time.time() < deadline:
        time.sleep(1)
        run = stack.flow_run(run_id)
    assert run["state_type"] == "FAILED" and run["run_count"] <= 1, run["state"]
    assert run["state"]["message"] == "invalid job: output: empty location", run["state"]["message"]
    assert run["name"] == f"llava · {tmp_path}", run["name"]  # not Prefect's random name
