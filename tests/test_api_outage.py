"""The Prefect API goes away mid-run (a server restart, an upgrade, a network blip between a GPU
worker and the server) for longer than the clients retry, then comes back on the same database.

On the session's Prefect server on PostgreSQL with its two workers (tests/postgres.py), a prod
run captions a manifest of images served slowly over HTTP (DELAY_S each), one per shard, as
one-image groups (`multi-image`: the engine holds 2 shards at a time, so fetching, captioning
and writing go on at the pace of the slow source, for a minute); once it has written some parts the server is
stopped for OUTAGE_S (its clients give up after ~15 s) and started again. Expected: what was written
stays; the run goes on once the API is back, or ends FAILED/CRASHED with a message saying why;
a plain rerun completes; every object ends with exactly one record of its bytes; both workers
are back on the API and take the next run."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.images import image_bytes
from tests.postgres import BUCKET, FINAL
from tests.test_deployments import job_for, records_under

pytestmark = pytest.mark.timeout(1500)
COUNT = 30
DELAY_S = 2.0
OUTAGE_S = 40  # past the clients' ~15 s of retries, inside the zombie automation's 90 s
OUT = "outage-captions"


class SlowMedia:
    """Images over HTTP, each answered after `delay` seconds."""

    def __init__(self, bodies: dict[str, bytes]):
        self.delay = DELAY_S
        media = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                time.sleep(media.delay)
                body = bodies.get(self.path.lstrip("/"))
                self.send_response(200 if body else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def slow_manifest(s3_client):
    """A job manifest in the bucket whose lines point at SlowMedia; yields (server, manifest URI, hashes)."""
    bodies = {f"o-{i:03d}.jpg": image_bytes(size=(52 + i, 40), color=(i * 8 % 255, 30, 200)) for i in range(COUNT)}
    media = SlowMedia(bodies)
    lines = [json.dumps({"id": name, "media": [f"{media.url}/{name}"]}) for name in bodies]
    s3_client.put_object(Bucket=BUCKET, Key="outage/jobs.jsonl", Body="\n".join(lines).encode())
    yield media, f"s3://{BUCKET}/outage/jobs.jsonl", {k: hashlib.sha256(v).hexdigest() for k, v in bodies.items()}
    media.server.shutdown()


def _wait_for_records(stack, s3_client, run_id: str, at_least: int) -> None:
    deadline = time.time() + 600
    while time.time() < deadline:
        run = stack.flow_run(run_id)
        assert run["state_type"] not in FINAL, f"the run ended before the outage: {run['state']}"
        if run["state_type"] == "RUNNING" and len(records_under(s3_client, f"{OUT}/results/")) >= at_least:
            return
        time.sleep(0.5)
    raise TimeoutError(f"no records within 10 min; logs in {stack.root}")


def _wait_for_an_end(stack, run_id: str) -> dict:
    """The run once it is final, or failed and waiting for the deployment's retry (300 s later)."""
    deadline = time.time() + 600
    while time.time() < deadline:
        run = stack.flow_run(run_id)
        if run["state_type"] in FINAL or run["state_name"] == "AwaitingRetry":
            return run
        time.sleep(3)
    raise TimeoutError(f"the run neither went on nor ended after the API came back; logs in {stack.root}")


def _online_after(stack, moment: datetime) -> set[str]:
    """Workers whose heartbeat reached the restarted server."""
    workers = stack.post("/work_pools/vlm-caption-gpu/workers/filter", {})
    return {w["name"] for w in workers
            if w["last_heartbeat_time"] and datetime.fromisoformat(w["last_heartbeat_time"]) > moment}


def test_api_outage_mid_run_loses_and_duplicates_nothing(prefect_stack, s3_client, tiny_llava, slow_manifest):
    stack = prefect_stack
    media, manifest, hashes = slow_manifest
    job = job_for("outage", tiny_llava, fan_out=1, shard_size=1, output=f"s3://{BUCKET}/{OUT}/")
    job = {**{k: v for k, v in job.items() if k != "source"}, "manifest": manifest, "modality": "multi-image"}
    run_id = stack.run_deployment("vlm-caption/prod", job)
    _wait_for_records(stack, s3_client, run_id, at_least=2)

    stack.stop_server()
    before = {r["key"] for r in records_under(s3_client, f"{OUT}/results/")}
    time.sleep(OUTAGE_S)
    during = {r["key"] for r in records_under(s3_client, f"{OUT}/results/")}
    stack.start_server()
    back = datetime.now(timezone.utc)
    assert before <= during  # what was written stays

    run = _wait_for_an_end(stack, run_id)
    media.delay = 0  # the rerun fetches at full speed (URLs have no etag: done items are known by hash)
    if run["state_type"] != "COMPLETED":  # a clear end, with the reason
        assert run["state"]["message"], run["state"]
    # A plain rerun of the same job (the dev deployment: the prod run's own retry waits 300 s).
    rerun = stack.wait_for(stack.run_deployment("vlm-caption/dev", job), timeout=600)
    assert rerun["state_type"] == "COMPLETED", stack.log_tail("server", *[f"worker-{w}" for w in stack.workers])

    # Final records only: a fetch that failed is a retryable record the rerun computes again.
    records = [r for r in records_under(s3_client, f"{OUT}/results/") if not (r["error"] or {}).get("retryable")]
    counts = Counter(r["key"] for r in records)
    report = {"outage_s": OUTAGE_S, "written_before": len(before), "written_during": len(during) - len(before),
              "first_run": run["state_type"], "first_run_message": run["state"]["message"],
              "lost": COUNT - len(counts), "duplicated": sum(c - 1 for c in counts.values())}
    print("OUTAGE-REPORT " + json.dumps(report))
    assert counts == Counter(list(hashes)), report  # every object once: none lost, none twice
    assert all(r["error"] is None and r["members"][0]["sha256"] == hashes[r["key"]] for r in records), records
    (last,) = [m for m in manifests_of(s3_client) if m["run_id"].startswith(rerun["id"][:8])]
    assert last["counts"]["processed"] + last["counts"]["skipped_already_done"] == COUNT
    assert _online_after(stack, back) >= set(stack.workers), "a worker did not come back to the API"


def manifests_of(s3_client) -> list[dict]:
    found = s3_client.list_objects_v2(Bucket=BUCKET, Prefix=f"{OUT}/manifests/").get("Contents", [])
    return [json.loads(s3_client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()) for o in found
            if o["Key"].endswith(".json")]  # not the run's gallery page beside it
