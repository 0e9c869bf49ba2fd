"""Storage credentials never leak: with boto3 and Prefect logging at DEBUG, the access key, the
secret key and the session token appear in no log line, artifact, manifest, record or flow-run
parameter of a run that read and wrote S3 with them."""

from __future__ import annotations

import json
import logging

import boto3

from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.params import CaptionJob
from tests.images import image_bytes

SECRETS = {"AWS_ACCESS_KEY_ID": "AKIAVLMCAPTIONLEAKTEST",
           "AWS_SECRET_ACCESS_KEY": "vlm-caption-secret-4f1d9a7c-never-print-me",
           "AWS_SESSION_TOKEN": "vlm-caption-session-token-b83e55-never-print-me"}


def test_credentials_appear_nowhere(prefect_api, s3_endpoint, tiny_llava, monkeypatch, capfd, caplog):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, LogFilter,
                                                LogFilterFlowRunId)
    from prefect.logging.handlers import APILogHandler

    from vlm_caption.tasks.settings import get_settings

    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    caplog.set_level(logging.DEBUG)
    for name in ("boto3", "botocore", "s3transfer", "urllib3", "prefect"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="secret-test")
    for i in range(3):
        client.put_object(Bucket="secret-test", Key=f"in/{i}.jpg", Body=image_bytes(color=(i * 60, 10, 10)))

    capfd.readouterr()  # only what the run itself prints counts, not this test's own uploads
    caplog.clear()
    state = vlm_caption(CaptionJob(source="s3://secret-test/in/", output="s3://secret-test/out/",
                                   model=str(tiny_llava), sampling={"max_tokens": 3}), return_state=True)
    assert state.is_completed(), state.message
    APILogHandler().flush()
    flow_run_id = state.state_details.flow_run_id
    seen = [capfd.readouterr().err, capfd.readouterr().out, caplog.text]
    with get_client(sync_client=True) as prefect:
        seen.append(json.dumps(prefect.read_flow_run(flow_run_id).parameters))
        seen += [log.message for log in prefect.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))]
        seen += [json.dumps(a.data) for a in prefect.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))]
    for obj in client.list_objects_v2(Bucket="secret-test", Prefix="out/")["Contents"]:
        seen.append(client.get_object(Bucket="secret-test", Key=obj["Key"])["Body"].read().decode("latin-1"))  # the Parquet view's files too
    assert any("botocore" in text for text in seen)  # DEBUG logging was really on
    everything = "\n".join(seen)
    for key, value in SECRETS.items():
        assert value not in everything, f"{key} leaked"
    get_settings.cache_clear()
