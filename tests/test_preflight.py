"""Bad parameters fail before any engine starts, with a message that says what to do, and leave
nothing behind: unknown recipe, modality or engine argument, a bad scheme, a missing bucket or
folder, a source that cannot be listed, an output that cannot be written, no credentials."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

import flows.caption
import flows.pipeline
from flows.caption import vlm_caption
from flows.params import CaptionJob
from recipes import RecipeError
from tasks.sources.storage import StorageError


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an engine was started for a job that should have been refused")

    monkeypatch.setattr(flows.pipeline, "start_engine", refuse)  # where the shard pipeline finds them
    monkeypatch.setattr(flows.pipeline, "ShardStream", refuse)


def run(**fields):
    return vlm_caption(CaptionJob(**fields))


@pytest.mark.parametrize("fields, message", [
    ({"recipe": "lava"}, "unknown recipe 'lava'"),
    ({"recipe": "llava", "modality": "video"}, "does not support modality 'video'"),
    ({"source": "gs://bucket/x/"}, "unsupported scheme 'gs'"),
    ({"source": "s3:///x/"}, "missing bucket name"),
])
def test_bad_job_fields_are_refused_when_the_job_is_built(tmp_path, fields, message):
    with pytest.raises(ValidationError, match=message):
        CaptionJob(**{"source": str(tmp_path), "output": str(tmp_path / "out"), **fields})


def test_unknown_engine_argument_names_close_matches(prefect_api, tmp_path, no_engine):
    with pytest.raises(RecipeError, match="unknown vLLM engine argument 'max_model_length'.*max_model_len"):
        run(source=str(tmp_path), output=str(tmp_path / "out"), engine_overrides={"max_model_length": 4096})
    assert not (tmp_path / "out").exists()


def test_missing_folder_and_bucket_and_manifest(prefect_api, tmp_path, s3_client, no_engine):
    with pytest.raises(StorageError, match="no such folder"):
        run(source=str(tmp_path / "nope"), output=str(tmp_path / "out"))
    with pytest.raises(StorageError, match="bucket .*does not exist"):
        run(source="s3://no-such-bucket/images/", output=str(tmp_path / "out"))
    with pytest.raises(StorageError, match="manifest not found"):
        run(manifest=str(tmp_path / "jobs.jsonl"), output=str(tmp_path / "out"), recipe="idefics3",
            modality="multi-image")


def test_an_output_that_cannot_be_written(prefect_api, tmp_path, s3_client, no_engine):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(StorageError, match="writing a probe object"):
        run(source=str(tmp_path), output=str(tmp_path / "a-file" / "out"))
    s3_client.create_bucket(Bucket="in-only")
    with pytest.raises(StorageError, match="does not exist"):
        run(source="s3://in-only/", output="s3://no-such-output-bucket/captions/")


def test_a_good_output_keeps_no_probe(prefect_api, tmp_path):
    from tasks.sources.preflight import check_output

    check_output(str(tmp_path / "out"))
    assert list((tmp_path / "out").iterdir()) == []


def test_missing_credentials_say_how_to_give_them(prefect_api, tmp_path, s3_endpoint, monkeypatch, no_engine):
    from tasks.settings import get_settings

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    get_settings.cache_clear()
    try:
        with pytest.raises(StorageError, match="no S3 credentials.*AWS_ACCESS_KEY_ID.*VLM_CAPTION_AWS_CREDENTIALS_BLOCK"):
            run(source="s3://any-bucket/images/", output=str(tmp_path / "out"))
    finally:
        get_settings.cache_clear()
    assert not (tmp_path / "out").exists()
