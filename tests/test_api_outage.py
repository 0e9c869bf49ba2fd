"""The Prefect API goes away mid-run (a server restart, an upgrade, a network blip between a GPU
worker and the server) for longer than the clients retry, then comes back on the same database.

On the session's Prefect server on PostgreSQL with its two workers (tests/postgres.py), a prod
run captions a manifest of COUNT images over HTTP, one per shard, as one-image groups
(`multi-image`), each shard's part written once its image is served and captioned. The HTTP
server hands out the images in steps the test sets: READY at once (so some parts are written),
then, once the API server is stopped, one now and then through the outage
(parts are written while the API is away), and the rest only after the API is back (so the run
is still going when it returns, and ends talking to it). Expected: what was written stays; the
run goes on once the API is back, or ends FAILED/CRASHED with a message saying why; a plain
rerun completes; every object ends with exactly one record of its bytes; both workers are back
on the API and one takes the next run (the rerun).

    uv run pytest tests/test_api_outage.py -s   # prints its OUTAGE-REPORT line
"""

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

pytestmark = pytest.mark.timeout(1200)
COUNT = 8
READY = 4  # served at once: parts 0 and 1 are written before the outage
DURING = 2  # served while the API is away
OUT = "outage-captions"


def client_retries_s(max_retries: int) -> float:
    """How long a Prefect client keeps retrying an unreachable API: 2, 4, 8 ... s between its
    tries (prefect/client/base.py), each up to ~20% longer (PREFECT_CLIENT_RETRY_JITTER_FACTOR)."""
    return 1.2 * sum(2 ** n for n in range(1, max_retries + 1))


class GatedMedia:
    """Images over HTTP; the i-th is answered in full once `release` has let i+1 through. Until
    then its headers are sent and one byte of its body every few seconds, so the fetch's 30 s
    read timeout does not fire while it waits (a slow source, not a broken one)."""

    def __init__(self, bodies: dict[str, bytes], released: int):
        self.gates = {name: threading.Event() for name in bodies}
        self.order = list(bodies)
        self.released = 0
        self.release(released)
        media = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.lstrip("/")
                body = bodies.get(name)
                self.send_response(200 if body else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                sent = 0
                try:
                    while body and not media.gates[name].wait(5):
                        if sent < len(body) - 1:
                            self.wfile.write(body[sent:sent + 1])
                            sent += 1
                    self.wfile.write((body or b"")[sent:])
                except OSError:  # the client gave up
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def release(self, count: int) -> None:
        for name in self.order[self.released:self.released + count]:
            self.gates[name].set()
        self.released = min(len(self.order), self.released + count)

    def close(self) -> None:
        self.release(len(self.order))
        self.server.shutdown()


@pytest.fixture
def gated_manifest(s3_client):
    """A job manifest in the bucket whose lines point at GatedMedia; yields (media, manifest URI, hashes)."""
    bodies = {f"o-{i:03d}.jpg": image_bytes(size=(52 + i, 40), color=(i * 8 % 255, 30, 200)) for i in range(COUNT)}
    media = GatedMedia(bodies, released=READY)
    lines = [json.dumps({"id": name, "media": [f"{media.url}/{name}"]}) for name in bodies]
    s3_client.put_object(Bucket=BUCKET, Key="outage/jobs.jsonl", Body="\n".join(lines).encode())
    yield media, f"s3://{BUCKET}/outage/jobs.jsonl", {k: hashlib.sha256(v).hexdigest() for k, v in bodies.items()}
    media.close()


def _written(s3_client) -> set[str]:
    return {r["key"] for r in records_under(s3_client, f"{OUT}/")}


def _wait_for_records(stack, s3_client, run_id: str, at_least: int) -> None:
    deadline = time.time() + 600
    while time.time() < deadline:
        run = stack.flow_run(run_id)
        assert run["state_type"] not in FINAL, f"the run ended before the outage: {run['state']}"
        if run["state_type"] == "RUNNING" and len(_written(s3_client)) >= at_least:
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
        time.sleep(2)
    raise TimeoutError(f"the run neither went on nor ended after the API came back; logs in {stack.root}")


def _workers_back(stack, moment: datetime, timeout: float = 120) -> set[str]:
    """The workers whose heartbeat reached the restarted server (they beat every 30 s)."""
    deadline = time.time() + timeout
    while True:
        workers = stack.post("/work_pools/vlm-caption-gpu/workers/filter", {})
        back = {w["name"] for w in workers
                if w["last_heartbeat_time"] and datetime.fromisoformat(w["last_heartbeat_time"]) > moment}
        if back >= set(stack.workers) or time.time() > deadline:
            return back
        time.sleep(2)


def test_api_outage_mid_run_loses_and_duplicates_nothing(prefect_stack, s3_client, tiny_llava, gated_manifest):
    stack = prefect_stack
    media, manifest, hashes = gated_manifest
    outage_s = 20.0  # the server is away this long, plus its stop and start
    assert outage_s > client_retries_s(int(stack.env["PREFECT_CLIENT_MAX_RETRIES"])), "not past the retries"
    job = job_for("outage", tiny_llava, fan_out=1, shard_size=1, output=f"s3://{BUCKET}/{OUT}/")
    job = {**{k: v for k, v in job.items() if k != "source"}, "manifest": manifest, "modality": "multi-image"}
    run_id = stack.run_deployment("vlm-caption/prod", job)
    _wait_for_records(stack, s3_client, run_id, at_least=READY - 2)

    down = time.time()
    stack.stop_server()
    before = _written(s3_client)
    for _ in range(DURING):  # the run keeps fetching, captioning and writing while the API is away
        time.sleep(outage_s / (DURING + 1))
        media.release(1)
    time.sleep(max(0.0, outage_s - (time.time() - down)))
    during = _written(s3_client)
    stack.start_server()
    back = datetime.now(timezone.utc)
    away_s = time.time() - down
    media.release(COUNT)  # the rest: the run is still at work when the API is back
    assert before <= during  # what was written stays

    run = _wait_for_an_end(stack, run_id)
    if run["state_type"] != "COMPLETED":  # a clear end, with the reason
        assert run["state"]["message"], run["state"]
    # A plain rerun of the same job: the dev deployment (a failed prod run's own retry waits 300 s
    # and holds the prod deployment's slot until then). A worker back on the API takes it.
    rerun = stack.wait_for(stack.run_deployment("vlm-caption/dev", job), timeout=600)
    assert rerun["state_type"] == "COMPLETED", stack.log_tail("server", *[f"worker-{w}" for w in stack.workers])

    # Final records only: a fetch that failed is a retryable record the rerun computes again.
    records = [r for r in records_under(s3_client, f"{OUT}/") if not (r["error"] or {}).get("retryable")]
    counts = Counter(r["key"] for r in records)
    report = {"outage_s": round(away_s, 1), "written_before": len(before), "written_during": len(during - before),
              "first_run": run["state_name"], "first_run_message": run["state"]["message"],
              "lost": COUNT - len(counts), "duplicated": sum(c - 1 for c in counts.values())}
    print("OUTAGE-REPORT " + json.dumps(report))
    assert counts == Counter(list(hashes)), report  # every object once: none lost, none twice
    assert all(r["error"] is None and r["members"][0]["sha256"] == hashes[r["key"]] for r in records), records
    (last,) = [m for m in manifests_of(s3_client) if m["run_id"].startswith(rerun["id"][:8])]
    assert last["counts"]["processed"] + last["counts"]["skipped_already_done"] == COUNT, last["counts"]
    assert _workers_back(stack, back) >= set(stack.workers), "a worker did not come back to the API"


def manifests_of(s3_client) -> list[dict]:
    found = s3_client.list_objects_v2(Bucket=BUCKET, Prefix=f"{OUT}/manifests/").get("Contents", [])
    return [json.loads(s3_client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()) for o in found
            if o["Key"].endswith(".json")]  # not the run's gallery page beside it
