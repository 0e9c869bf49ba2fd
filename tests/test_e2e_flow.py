"""End to end: a bucket of images -> the vlm-caption flow (real vLLM on CPU, real Prefect API,
real S3 over HTTP) -> one record per object in the bucket; a rerun recomputes nothing."""

import json


from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.params import CaptionJob
from tests.images import corrupt_jpeg, image_bytes
from tests.pages import gallery_items
from tests.result_files import s3_records


BUCKET = "media"


def _upload_images(s3_client) -> dict[str, bytes]:
    s3_client.create_bucket(Bucket=BUCKET)
    objects = {}
    for i in range(18):
        fmt = ("JPEG", "PNG", "WEBP")[i % 3]
        color = (i * 13 % 256, 255 - i * 9 % 256, i * 29 % 256)
        objects[f"images/{i:02d}.{fmt.lower()}"] = image_bytes(fmt, size=(96 + i, 72), color=color)
    objects["images/broken.jpg"] = corrupt_jpeg()
    objects["images/notes.txt"] = b"this is not an image"
    for key, body in objects.items():
        s3_client.put_object(Bucket=BUCKET, Key=key, Body=body)
    return objects


def _records(s3_client, keys: list[str] | None = None) -> list[dict]:
    """The output's records (its view's files and any part not folded), or those of the files `keys`."""
    return s3_records(s3_client, BUCKET, "captions/", keys)


def _count_s3_clients(monkeypatch) -> list:
    """Every S3 client made in this process from now on, counted from none: the shared ones an
    earlier test left are dropped (for this test only)."""
    import vlm_caption.tasks.sources.s3_client as s3_client
    import vlm_caption.tasks.sources.storage as storage

    made, make = [], s3_client.make_s3_client
    monkeypatch.setattr(s3_client, "_shared_clients", {})
    monkeypatch.setattr(storage, "_shared_stores", {})
    monkeypatch.setattr(s3_client, "make_s3_client", lambda: made.append(1) or make())
    return made


def test_bucket_to_captions_and_rerun_recomputes_nothing(prefect_api, s3_client, tiny_llava, monkeypatch):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId,
                                                LogFilter, LogFilterFlowRunId)
    from prefect.logging.handlers import APILogHandler

    objects = _upload_images(s3_client)
    clients = _count_s3_clients(monkeypatch)
    job = CaptionJob(
        source=f"s3://{BUCKET}/images/", output=f"s3://{BUCKET}/captions/", recipe="llava",
        model=str(tiny_llava), shard_size=6, sampling={"max_tokens": 8},
    )

    state = vlm_caption(job, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    records = _records(s3_client)

    # One record per object, each with its content hash and a caption or an error.
    assert sorted(r["key"] for r in records) == sorted(k.removeprefix("images/") for k in objects)
    by_key = {r["key"]: r for r in records}
    assert by_key["broken.jpg"]["error"]["kind"] == "decode"
    assert by_key["notes.txt"]["error"]["kind"] == "decode"
    good = [r for r in records if r["error"] is None]
    assert len(good) == 18
    import hashlib
    for r in good:
        assert r["text"] is not None and r["finish_reason"] in ("length", "stop")
        assert r["sha256"] == hashlib.sha256(objects["images/" + r["key"]]).hexdigest()
        assert r["prompt"] == "USER: <image>\nDescribe the content of this image in detail.\nASSISTANT:"
        assert r["prompt_tokens"] > 60 and 0 < r["output_tokens"] <= 8  # 64 image tokens + text
        assert r["recipe"] == "llava" and r["model"] == str(tiny_llava)

    # The manifest, written last, adds up.
    manifest = json.loads(s3_client.get_object(Bucket=BUCKET, Key=f"captions/manifests/{summary['run_id']}.json")["Body"].read())
    counts = manifest["counts"]
    assert counts["listed"] == 20 and counts["processed"] == 20
    assert counts["succeeded"] + counts["failed"] == counts["processed"]
    assert counts["failed_by_kind"] == {"decode": 2}
    assert sorted(f["key"] for f in manifest["failures"]) == ["broken.jpg", "notes.txt"]
    assert counts["output_tokens"] == sum(r["output_tokens"] for r in records)
    assert len(manifest["parts"]) == 4  # 20 objects / shard size 6
    assert manifest["parameters"]["recipe"] == "llava" and "prefect" in manifest["versions"]
    # Its gallery on S3 shows every item: the 18 images with thumbnails, the two failures too.
    page = s3_client.get_object(Bucket=BUCKET, Key=f"captions/manifests/{summary['run_id']}.html")["Body"].read()
    shown = gallery_items(page.decode())
    assert set(shown) == {r["key"] for r in records} and manifest["gallery"]["items"] == 20
    assert {key for key, picture in shown.items() if picture == "thumb"} == {r["key"] for r in good}
    # The summary's figures are the records written.
    assert (summary["succeeded"], summary["failed"]) == (len(good), len(records) - len(good))

    # The Prefect API knows the run: Completed, named after recipe and source, with artifacts and logs.
    flow_run_id = state.state_details.flow_run_id
    APILogHandler().flush()  # logs are shipped in batches; send what is queued
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        assert run.state.is_completed()
        assert run.name == f"llava · s3://{BUCKET}/images/"
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        by_key = {a.key: a for a in artifacts}
        assert by_key["vlm-caption-progress"].data == 100.0
        table = by_key["vlm-caption-summary"].data
        table = json.loads(table) if isinstance(table, str) else table
        assert {"metric": "succeeded", "value": "18"} in table
        assert "vlm-caption-samples" in by_key
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        # Our lines read `event key=value` in the UI's log tab, not a JSON string (stderr keeps JSON).
        ours = [log.message for log in logs if log.name == "vlm_caption"]
        assert not any(message.startswith("shard done") for message in ours), ours[:5]  # a line per batch
        assert not any(message.startswith("{") for message in ours), ours[:5]
        # A job with no result yet starts building its engine before the done-index is read and
        # the listing begins ("run started" follows both), not at the first listed shard.
        ordered = [log.message for log in sorted(logs, key=lambda log: log.timestamp) if log.name == "vlm_caption"]
        first = next(i for i, message in enumerate(ordered) if message.startswith("engine starting first"))
        assert first < next(i for i, message in enumerate(ordered) if message.startswith("run started"))
        # Prefect sees the shards a batch at a time (flows/batches.py), not three task runs
        # per shard: 1 shard, then 2, then the last one; each batch's task run Completed, its log
        # line its counts. (The schedule of the steps is tests/test_pipeline_schedule.py's.)
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        batches = [t for t in task_runs if t.name.startswith("caption-batch-")]
        assert sorted(t.name for t in batches) == ["caption-batch-1", "caption-batch-2", "caption-batch-3"]
        assert all(t.state.is_completed() for t in batches), [t.state for t in batches]
        assert not [t.name for t in task_runs if t.name.rsplit("-", 1)[0].endswith("-shard")]
        batch_lines = sorted(m for m in ours if m.startswith("batch done "))
        assert [line.split("batch=")[1].split()[0] for line in batch_lines] == ["1", "2", "3"]
        assert [line.split("shards=")[1].split()[0] for line in batch_lines] == ["1", "2", "1"]
        assert sum(int(line.split(" items=")[1].split()[0]) for line in batch_lines) == 20

    # One S3 client for the whole run (source and output share it): the listing, 4 shards'
    # fetches, the parts, the done-index, two manifest writes, the export, the gallery.
    assert len(clients) == 1

    # Same parameters again: everything is already done; nothing recomputed or duplicated.
    again = vlm_caption(job)
    assert again["listed"] == 20 and again["skipped_already_done"] == 20 and again["processed"] == 0
    assert len(_records(s3_client)) == 20

    # A new object is the only thing the next run computes.
    s3_client.put_object(Bucket=BUCKET, Key="images/new.png", Body=image_bytes("PNG", color=(1, 2, 3)))
    third_state = vlm_caption(job, return_state=True)
    third = third_state.result()
    # With results already there, the engine waited for the listing to show the new object.
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[third_state.state_details.flow_run_id])))
    assert not any(log.message.startswith("engine starting first") for log in logs)
    assert third["processed"] == 1 and third["succeeded"] == 1 and third["skipped_already_done"] == 20
    assert len(_records(s3_client)) == 21

    # A run killed before its fold leaves its parts in the view (here the first run's, made again
    # from its view file, which goes): one of them cut short, a file that is not Parquet and a
    # foreign file among them. The done-index reads the readable parts; each unreadable file is
    # skipped with a warning naming it, and only the lost items are computed again. The next run
    # folds the readable parts and names the others.
    import io

    import pyarrow.parquet as pq

    first_run, fingerprint = summary["run_id"], summary["fingerprint"]
    view_key = f"captions/parquet/run-{first_run}.parquet"
    table = pq.read_table(io.BytesIO(s3_client.get_object(Bucket=BUCKET, Key=view_key)["Body"].read()))
    s3_client.delete_object(Bucket=BUCKET, Key=view_key)
    prefix = f"captions/parquet/{fingerprint}/part-{first_run}-"
    for shard, start in enumerate(range(0, len(table), 6)):
        sink = io.BytesIO()
        pq.write_table(table.slice(start, 6), sink)
        s3_client.put_object(Bucket=BUCKET, Key=f"{prefix}{shard:05d}.parquet", Body=sink.getvalue())
    damaged, junk = f"{prefix}00000.parquet", f"{prefix}00099.parquet"
    body = s3_client.get_object(Bucket=BUCKET, Key=damaged)["Body"].read()
    s3_client.put_object(Bucket=BUCKET, Key=damaged, Body=body[: len(body) // 2])
    s3_client.put_object(Bucket=BUCKET, Key=junk, Body=b"\xff\xfe\x00binary")
    s3_client.put_object(Bucket=BUCKET, Key=f"captions/parquet/{fingerprint}/notes.txt", Body=b"not a part")
    lost = min(6, len(table))
    fourth = vlm_caption(job)
    assert fourth["processed"] == lost and fourth["succeeded"] + fourth["failed"] == lost
    # The Parquet view's files, read as one: every result once (runs 1, 3 and 4 added some); the
    # first run's file made again by the fourth run from its readable parts, which are gone.
    views = [o["Key"] for o in s3_client.list_objects_v2(Bucket=BUCKET, Prefix="captions/parquet/")["Contents"]
             if o["Key"].count("/") == 2]
    valid = [record["key"] for record in _records(s3_client, views)]
    assert sorted(valid) == sorted([k.removeprefix("images/") for k in objects] + ["new.png"])  # each once
    assert len(views) == 3 and view_key in views
    left = [o["Key"] for o in s3_client.list_objects_v2(Bucket=BUCKET, Prefix=f"captions/parquet/{fingerprint}/")
            ["Contents"]]
    assert sorted(left) == sorted([damaged, junk, f"captions/parquet/{fingerprint}/notes.txt"])
    ended = json.loads(s3_client.get_object(Bucket=BUCKET, Key=f"captions/manifests/{fourth['run_id']}.json")["Body"].read())
    repaired = ended["parquet"]["repaired"][first_run]  # the unreadable files named
    assert sorted(repaired["skipped"]) == sorted(f"s3://{BUCKET}/{key}" for key in (damaged, junk)), repaired
    assert len(clients) == 1  # four runs in this process, still the one client
