"""Storage faults between the flow and S3: a fault-injecting proxy in front of the moto server
fails ~10% (then ~30%) of LIST, GET, HEAD and PUT requests with 500, 503 SlowDown, connection
resets, stalls past the read timeout and truncated bodies. Every object ends with exactly one
record; a truncated body is never captioned; a result part is never left half-written.

The same holds with the client production uses: one made from a prefect-aws `AwsCredentials` or
`MinIOCredentials` block loaded by name (`deployments/prefect.yaml` names one for every run), over
images, WebDataset tars and Parquet files (format `auto`: found through the faults too)."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter

import boto3
import pytest

from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.params import CaptionJob
from tests.fault_proxy import FaultProxy
from tests.images import image_bytes
from tests.result_files import s3_keys, s3_records

BUCKET = "faulty"
COUNT = 200


@pytest.fixture(scope="module")
def bucket(s3_endpoint):
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket=BUCKET)
    objects = {}
    for i in range(COUNT):
        body = image_bytes(size=(48 + i % 17, 40), color=(i % 251, (i * 7) % 251, 90))
        client.put_object(Bucket=BUCKET, Key=f"in/{i:03d}.jpg", Body=body)
        objects[f"{i:03d}.jpg"] = hashlib.sha256(body).hexdigest()
    return client, objects


def _records(client, out: str, bucket: str = BUCKET) -> list[dict]:
    # every Parquet file reads whole: a file is one PUT, never a partial write
    return s3_records(client, bucket, out)


def _next_night(job: CaptionJob, proxy: FaultProxy, client, bucket: str, out: str) -> int:
    """A part a stalled PUT delivered late (the client gave up, its retry was stored, and the fold
    deleted that part before the first PUT reached the store, writing it again) shows its results
    twice until the next run of the job folds it, as it folds a killed run's. Any left: the next
    night run as the operator reruns (through the faults). How many were left."""
    time.sleep(proxy.stall_s + 1)  # every stalled request has reached the store
    late = _parts(client, bucket, out)
    if late:
        _until_complete(job, 3)
        time.sleep(proxy.stall_s + 1)
        assert not _parts(client, bucket, out)
    return len(late)


def _parts(client, bucket: str, out: str) -> list[str]:
    return [key for key in s3_keys(client, bucket, f"{out}parquet/") if "/part-" in key]


def _through(proxy: FaultProxy, monkeypatch, endpoint: bool = True):
    """The flow's S3 calls through `proxy`: by the endpoint setting, or (`endpoint=False`) by a
    credentials block's own endpoint, the setting unset."""
    from vlm_caption.tasks.settings import get_settings

    if endpoint:
        monkeypatch.setenv("VLM_CAPTION_S3_ENDPOINT_URL", proxy.url)
    else:
        monkeypatch.delenv("VLM_CAPTION_S3_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("VLM_CAPTION_S3_READ_TIMEOUT_S", "1")
    # The run's gallery still fetches pictures and writes its page through the faults, for 2 s of
    # pictures, not 20: through this proxy they took the whole 20 s of each run (boto3's backoff
    # and its adaptive rate limit after the 503s), a third of this module's time, and nothing here
    # checks the page. That the bound holds is tests/test_gallery.py's.
    monkeypatch.setenv("VLM_CAPTION_GALLERY_FETCH_S", "2")
    get_settings.cache_clear()


def _until_complete(job: CaptionJob, most: int) -> tuple[list[dict], int]:
    """The job run as an operator reruns it: again while a run leaves items retryable or fails at
    its start saying it may pass (the store kept failing past the client's retries: on a loaded
    machine a 1 s read timeout also catches answers that are merely slow), at most `most` runs.
    The completed runs' summaries, and how many runs failed at their start."""
    from vlm_caption.flows.plan import PreflightError

    summaries, failed_at_start = [], 0
    for _ in range(most):
        try:
            summaries.append(vlm_caption(job))
        except PreflightError as exc:
            assert "run the job again" in str(exc), exc  # only a store's transient failure may end a run here
            failed_at_start += 1
            continue
        if not summaries[-1]["failed"]:
            break
    return summaries, failed_at_start


@pytest.mark.parametrize("rate, most_runs", [(0.10, 1), (0.30, 4)])
def test_faults_lose_and_duplicate_nothing(prefect_api, bucket, s3_endpoint, tiny_llava, monkeypatch, rate, most_runs):
    from vlm_caption.tasks.settings import get_settings

    client, objects = bucket
    proxy = FaultProxy(s3_endpoint, rate=rate, stall_s=2.0, seed=int(rate * 100))
    out = f"out-{int(rate * 100)}/"
    job = CaptionJob(source=f"s3://{BUCKET}/in/", output=f"s3://{BUCKET}/{out}", model=str(tiny_llava),
                     shard_size=25, sampling={"max_tokens": 2})
    try:
        _through(proxy, monkeypatch)
        runs, failed_at_start = _until_complete(job, most_runs)
        late = _next_night(job, proxy, client, BUCKET, out)
    finally:
        proxy.close()
        get_settings.cache_clear()
    records = _records(client, out)
    final = [r for r in records if r["error"] is None or not r["error"]["retryable"]]
    counts = Counter(r["key"] for r in final)
    report = {"rate": rate, "injected": dict(proxy.injected), "requests": dict(proxy.requests), "items": COUNT,
              "lost": COUNT - len(counts), "duplicated": sum(c - 1 for c in counts.values()),
              "retryable_after_first_run": runs[0]["failed"] if runs else None,
              "recorded_failures": len(records) - len(final), "runs": len(runs), "failed_at_start": failed_at_start,
              "late_parts": late}
    print("FAULT-REPORT " + json.dumps(report))
    assert sum(proxy.injected.values()) > 0 and set(proxy.injected) == {"500", "503", "reset", "stall", "truncate"}
    assert report["lost"] == 0 and report["duplicated"] == 0
    for record in final:
        assert record["error"] is None and record["sha256"] == objects[record["key"]]  # never wrong bytes
    if rate <= 0.10:
        assert failed_at_start == 0 and runs[0]["succeeded"] == COUNT and runs[0]["failed"] == 0  # the first run completes everything


@pytest.mark.parametrize("modality", ["video", "multi-image"])
def test_videos_and_groups_under_faults_lose_and_duplicate_nothing(prefect_api, s3_endpoint, checkpoints_root,
                                                                   monkeypatch, modality):
    """The same faults while fetching videos (one object each) and image groups (one item per
    folder, several GETs each): every item ends with exactly one record, of the right bytes."""
    from vlm_caption.tasks.settings import get_settings
    from tests.checkpoints import build_checkpoint
    from tests.images import video_bytes

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    bucket = f"faulty-{modality}"
    client.create_bucket(Bucket=bucket)
    if modality == "video":
        objects = {f"in/clip{i:02d}.mp4": video_bytes(frames=8 + i % 5, seed=i) for i in range(16)}
        items = {key.removeprefix("in/"): [body] for key, body in objects.items()}
        extra = {"recipe": "qwen2_vl", "num_frames": 4, "model": str(build_checkpoint("qwen2_vl", checkpoints_root))}
    else:
        objects = {f"in/album{g:02d}/{n}.jpg": image_bytes(size=(40 + g, 30 + n), color=(g * 20, n * 90, 60))
                   for g in range(12) for n in range(2)}
        items = {f"album{g:02d}": [objects[f"in/album{g:02d}/{n}.jpg"] for n in range(2)] for g in range(12)}
        extra = {"recipe": "idefics3", "max_images": 2, "model": str(build_checkpoint("idefics3", checkpoints_root))}
    for key, body in objects.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)
    proxy = FaultProxy(s3_endpoint, rate=0.10, stall_s=2.0, seed=7)
    job = CaptionJob(source=f"s3://{bucket}/in/", output=f"s3://{bucket}/out/", modality=modality, shard_size=4,
                     sampling={"max_tokens": 2}, **extra)
    try:
        _through(proxy, monkeypatch)
        summary = vlm_caption(job)
        late = _next_night(job, proxy, client, bucket, "out/")
    finally:
        proxy.close()
        get_settings.cache_clear()
    records = _records(client, "out/", bucket)
    print("FAULT-REPORT " + json.dumps({"modality": modality, "injected": dict(proxy.injected),
                                        "items": len(items), "records": len(records), "failed": summary["failed"],
                                        "late_parts": late}))
    assert sum(proxy.injected.values()) > 0
    assert Counter(r["key"] for r in records) == Counter(list(items))  # every item once, none lost
    for record in records:
        assert record["error"] is None, record["error"]
        bodies = items[record["key"]]
        hashes = [hashlib.sha256(body).hexdigest() for body in bodies]
        if modality == "video":
            assert record["sha256"] == hashes[0]  # never a short or wrong body
        else:
            assert [m["sha256"] for m in record["members"]] == hashes


def _tar(samples: dict[str, bytes]) -> bytes:
    import io

    import webdataset as wds

    stream = io.BytesIO()
    with wds.TarWriter(stream) as sink:
        for key, jpg in samples.items():
            sink.write({"__key__": key, "jpg": jpg, "txt": f"alt {key}"})
    return stream.getvalue()


def _parquet(cells: list[bytes]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    stream = io.BytesIO()
    pq.write_table(pa.table({"image": pa.array(cells, pa.binary()), "row": list(range(len(cells)))}), stream,
                   row_group_size=4)
    return stream.getvalue()


@pytest.fixture(scope="module")
def sources(s3_endpoint):
    """Three small sources in one bucket: images, WebDataset tars and Parquet files, each with the
    sha256 of every item's media by the record key it gets."""
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="faulty-blocks")
    body = {i: image_bytes(size=(40 + i % 13, 36), color=(i * 9 % 251, 60, i * 5 % 251)) for i in range(24)}
    expected = {"images": {}, "webdataset": {}, "parquet": {}}
    for i in range(24):
        client.put_object(Bucket="faulty-blocks", Key=f"images/{i:02d}.jpg", Body=body[i])
        expected["images"][f"{i:02d}.jpg"] = body[i]
    for t in range(3):
        samples = {f"{i:06d}": body[i] for i in range(t * 8, t * 8 + 8)}
        client.put_object(Bucket="faulty-blocks", Key=f"wds/{t:05d}.tar", Body=_tar(samples))
        expected["webdataset"].update({f"{t:05d}.tar/{key}": jpg for key, jpg in samples.items()})
    for f in range(2):
        cells = [body[i] for i in range(f * 12, f * 12 + 12)]
        client.put_object(Bucket="faulty-blocks", Key=f"pq/{f}.parquet", Body=_parquet(cells))
        expected["parquet"].update({f"{f}.parquet/{row}": cell for row, cell in enumerate(cells)})
    prefixes = {"images": "images/", "webdataset": "wds/", "parquet": "pq/"}
    return client, prefixes, {name: {key: hashlib.sha256(b).hexdigest() for key, b in items.items()}
                              for name, items in expected.items()}


@pytest.mark.parametrize("kind, source", [("AwsCredentials", "images"), ("AwsCredentials", "webdataset"),
                                          ("MinIOCredentials", "parquet")])
def test_a_credentials_blocks_client_under_faults_loses_and_duplicates_nothing(prefect_api, sources, s3_endpoint,
                                                                              tiny_llava, monkeypatch, kind, source):
    """30% of requests faulted, the client made from a block saved to Prefect's API (its endpoint
    the proxy, its credentials the only ones): a transient fault is retried or recorded retryable,
    never final; a rerun completes the rest, and the manifest says what the client did. (A few
    dozen items: the 200-item runs above measure the rates; these show the block's client is the
    one that meets them.)"""
    import prefect_aws

    from vlm_caption.tasks.settings import get_settings

    client, prefixes, hashes = sources
    expected = hashes[source]
    proxy = FaultProxy(s3_endpoint, rate=0.30, stall_s=2.0, seed=len(kind) + len(source))
    name, parameters = f"faults-{kind.lower()}-{source}", {"aws_client_parameters": {"endpoint_url": proxy.url}}
    if kind == "AwsCredentials":
        prefect_aws.AwsCredentials(aws_access_key_id="block-key", aws_secret_access_key="block-secret-51",
                                   region_name="us-east-1", **parameters).save(name, overwrite=True)
        monkeypatch.setenv("VLM_CAPTION_AWS_CREDENTIALS_BLOCK", name)
    else:
        prefect_aws.MinIOCredentials(minio_root_user="block-user", minio_root_password="block-secret-51",
                                     region_name="us-east-1", **parameters).save(name, overwrite=True)
        monkeypatch.setenv("VLM_CAPTION_MINIO_CREDENTIALS_BLOCK", name)
    for chain in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # a client from the chain would fail at once
        monkeypatch.delenv(chain)
    out = f"out-{name}/"
    job = CaptionJob(source=f"s3://faulty-blocks/{prefixes[source]}", output=f"s3://faulty-blocks/{out}",
                     model=str(tiny_llava), shard_size=6, sampling={"max_tokens": 2}, gallery_items=0)
    try:
        _through(proxy, monkeypatch, endpoint=False)
        runs, failed_at_start = _until_complete(job, 4)  # what failed past the retries is retryable
        late = _next_night(job, proxy, client, "faulty-blocks", out)
    finally:
        proxy.close()
        get_settings.cache_clear()
    records = _records(client, out, "faulty-blocks")
    final = [r for r in records if r["error"] is None or not r["error"]["retryable"]]
    counts = Counter(r["key"] for r in final)
    report = {"kind": kind, "source": source, "injected": dict(proxy.injected), "requests": dict(proxy.requests),
              "items": len(expected), "lost": len(set(expected) - set(counts)),
              "duplicated": sum(c - 1 for c in counts.values()), "runs": len(runs), "failed_at_start": failed_at_start,
              "late_parts": late}
    print("FAULT-REPORT " + json.dumps(report))
    assert sum(proxy.injected.values()) > 0
    assert report["lost"] == 0 and report["duplicated"] == 0 and set(counts) == set(expected)
    for record in final:  # no fault became a final record, and nothing was captioned from wrong bytes
        assert record["error"] is None, record["error"]
        assert record["sha256"] == expected[record["key"]]
    manifest = json.loads(client.get_object(Bucket="faulty-blocks", Key=f"{out}manifests/{runs[-1]['run_id']}.json")
                          ["Body"].read())
    assert manifest["parameters"]["source_format"] == {"images": "files"}.get(source, source)
    assert manifest["s3"] == {"credentials": f"{kind} block {name!r}", "endpoint_url": proxy.url,
                              "retry_mode": "adaptive", "max_attempts": 8, "max_pool_connections": 64,
                              "read_timeout_s": 1.0, "connect_timeout_s": 1.0}
