"""The S3 client and the failures of the reads made through it.

A client made from a prefect-aws `AwsCredentials` or `MinIOCredentials` block, loaded by name from
Prefect's API as production does, has the same retries, timeouts and connection pool as one from
the AWS chain, plus the block's own endpoint and `Config` values. And every reader of a source
tells a failure that may pass (throttling, a timeout) from damage: the first is retried or
raised, never made into a final record; the second stays a `bad_input` record."""

from __future__ import annotations

import io
import itertools

import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from vlm_caption.tasks.settings import get_settings
from vlm_caption.tasks.sources import s3_client as transient
from vlm_caption.tasks.sources.items import ObjectRef
from vlm_caption.tasks.sources.s3_client import (describe_client, is_transient, make_s3_client, merged_config,
                                                  settings_config)
from vlm_caption.tasks.sources.storage import ShortBodyError, StorageError

BLOCK_ENDPOINT = "http://127.0.0.1:9"  # never called: the clients are only looked at


def _error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "x"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


@pytest.fixture
def settings(monkeypatch):
    """Our settings, the chain's credentials gone: a client from a block signs with the block's."""
    for name in ("VLM_CAPTION_S3_ENDPOINT_URL", "VLM_CAPTION_AWS_CREDENTIALS_BLOCK",
                 "VLM_CAPTION_MINIO_CREDENTIALS_BLOCK", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLM_CAPTION_S3_MAX_ATTEMPTS", "5")
    monkeypatch.setenv("VLM_CAPTION_S3_READ_TIMEOUT_S", "9")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    get_settings.cache_clear()
    yield monkeypatch
    get_settings.cache_clear()


def save_block(kind: str, name: str, key: str, secret: str, endpoint: str, config: dict | None = None) -> None:
    """A prefect-aws credentials block saved to the Prefect API under `name`, as an operator does."""
    import prefect_aws

    parameters = {"endpoint_url": endpoint, **({"config": config} if config else {})}
    if kind == "AwsCredentials":
        block = prefect_aws.AwsCredentials(aws_access_key_id=key, aws_secret_access_key=secret,
                                           region_name="us-east-1", aws_client_parameters=parameters)
    else:
        block = prefect_aws.MinIOCredentials(minio_root_user=key, minio_root_password=secret,
                                             region_name="us-east-1", aws_client_parameters=parameters)
    block.save(name, overwrite=True)


def use_block(monkeypatch, kind: str, name: str) -> None:
    setting = "VLM_CAPTION_AWS_CREDENTIALS_BLOCK" if kind == "AwsCredentials" else "VLM_CAPTION_MINIO_CREDENTIALS_BLOCK"
    monkeypatch.setenv(setting, name)
    get_settings.cache_clear()


def test_a_client_from_the_chain_has_our_retries_timeouts_and_pool(settings):
    settings.setenv("AWS_ACCESS_KEY_ID", "chain-key-0001")
    settings.setenv("AWS_SECRET_ACCESS_KEY", "chain-secret-0001")
    client = make_s3_client()
    config = client.meta.config
    assert config.retries == {"total_max_attempts": 5, "mode": "adaptive"}
    assert config.max_pool_connections == 64 and config.read_timeout == 9 and config.connect_timeout == 9
    assert describe_client(client) == {"credentials": "AWS chain", "endpoint_url": "https://s3.amazonaws.com",
                                       "retry_mode": "adaptive", "max_attempts": 5, "max_pool_connections": 64,
                                       "read_timeout_s": 9.0, "connect_timeout_s": 9.0}


@pytest.mark.parametrize("kind", ["AwsCredentials", "MinIOCredentials"])
def test_a_client_from_a_block_keeps_our_config_and_the_blocks_own(prefect_api, settings, kind):
    """Loaded by name, as `deployments/prefect.yaml`'s runs load theirs: the block's credentials,
    endpoint and `connect_timeout` (it sets one), our retries, read timeout and pool."""
    from vlm_caption.tasks.observability import redact

    name = f"client-test-{kind.lower()}"
    secret = f"{kind}-secret-0002"
    save_block(kind, name, f"{kind}-key-0002", secret, BLOCK_ENDPOINT, config={"connect_timeout": 7})
    use_block(settings, kind, name)
    client = make_s3_client()
    config = client.meta.config
    assert config.retries == {"total_max_attempts": 5, "mode": "adaptive"}
    assert config.max_pool_connections == 64 and config.read_timeout == 9
    assert config.connect_timeout == 7  # the block's
    assert client.meta.endpoint_url == BLOCK_ENDPOINT and client.meta.region_name == "us-east-1"
    assert describe_client(client)["credentials"] == f"{kind} block {name!r}"
    assert secret not in redact(f"signed with {secret}")  # what the client signs with is scrubbed

    settings.setenv("VLM_CAPTION_S3_ENDPOINT_URL", "http://127.0.0.1:10")  # the setting wins over the block's
    get_settings.cache_clear()
    assert make_s3_client().meta.endpoint_url == "http://127.0.0.1:10"


def test_a_blocks_config_is_merged_over_ours(settings):
    ours = settings_config()
    merged = merged_config(ours, Config(retries={"max_attempts": 2}, max_pool_connections=200, read_timeout=3))
    # botocore's max_attempts counts retries: 2 of them, 3 attempts; the adaptive mode is kept
    assert merged.retries == {"total_max_attempts": 3, "mode": "adaptive"}
    assert (merged.max_pool_connections, merged.read_timeout, merged.connect_timeout) == (200, 3, 9)
    standard = merged_config(ours, Config(retries={"mode": "standard"}))
    assert standard.retries == {"total_max_attempts": 5, "mode": "standard"}
    assert merged_config(ours, None) is ours


def test_transient_failures_are_told_from_permanent_ones():
    transient_ones = [_error("SlowDown", 503), _error("InternalError", 500), _error("Anything", 502),
                      _error("TooManyRequests", 429), _error("RequestTimeout", 400),
                      ReadTimeoutError(endpoint_url="http://x"), EndpointConnectionError(endpoint_url="http://x"),
                      ShortBodyError("cut"), ConnectionResetError(), TimeoutError()]
    permanent = [_error("NoSuchKey", 404), _error("AccessDenied", 403), _error("NoSuchBucket", 404),
                 FileNotFoundError("x"), ValueError("not parquet"), StorageError("no such folder")]
    assert [is_transient(e) for e in transient_ones] == [True] * len(transient_ones)
    assert [is_transient(e) for e in permanent] == [False] * len(permanent)


class FlakyStorage:
    """A bucket prefix that fails its first `failures` listings or ranged reads with `error`."""

    uri = "s3://flaky/"

    def __init__(self, objects: dict[str, bytes], error: Exception, failures: int):
        self.objects, self.error, self.failures = objects, error, failures

    def _maybe_fail(self):
        if self.failures:
            self.failures -= 1
            raise self.error

    def iter_objects(self, glob=None, prefix=""):
        self._maybe_fail()
        yield from (ObjectRef(k, len(v), f"e{len(v)}") for k, v in sorted(self.objects.items()))

    def read_range(self, key, start, length):
        self._maybe_fail()
        return self.objects[key][start:start + length]

    def describe(self, key):
        return f"{self.uri}{key}"


@pytest.fixture
def no_pause(monkeypatch):
    monkeypatch.setattr(transient, "PAUSE_S", 0.0)


def test_format_detection_retries_a_throttled_listing_and_never_guesses(monkeypatch, no_pause):
    """A prefix of tars is webdataset after two throttled pages; one that stays throttled is a
    pre-flight error that says so (a run retried later may pass), not `files`."""
    from vlm_caption.flows.params import CaptionJob
    from vlm_caption.tasks.sources import formats
    from vlm_caption.tasks.sources.preflight import resolve_source
    from vlm_caption.tasks.sources.registry import detect_format

    store = FlakyStorage({"00000.tar": b"x"}, _error("SlowDown", 503), failures=2)
    monkeypatch.setattr(formats, "source_storage", lambda uri, follow_links=False: store)
    assert detect_format("s3://flaky/", "auto", False) == "webdataset"

    store.failures = 10
    job = CaptionJob(source="s3://flaky/", output="/tmp/out", model="m", source_format="auto")
    with pytest.raises(StorageError, match="kept failing while listing the source.*SlowDown.*run the job again") as got:
        resolve_source(job)
    assert got.value.permanent is False
    store.failures, store.error = 10, _error("AccessDenied", 403)
    with pytest.raises(StorageError, match="access denied") as got:
        resolve_source(job)
    assert got.value.permanent is True and store.failures == 9  # not retried: it would only repeat


def _parquet_bytes() -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.table({"url": ["a.jpg", "b.jpg"], "width": [1, 2]}), buffer)
    return buffer.getvalue()


def test_a_parquet_file_that_times_out_is_retried_or_raised_never_bad_input(no_pause):
    from vlm_caption.tasks.sources.parquet_source import parquet_items

    data = _parquet_bytes()
    ref = ObjectRef("a.parquet", len(data), "e")
    store = FlakyStorage({"a.parquet": data}, ReadTimeoutError(endpoint_url="http://x"), failures=2)
    items = list(parquet_items(store, ref, None))  # two timeouts, then read
    assert [item.id for item in items] == ["a.parquet/0", "a.parquet/1"] and not any(i.problem for i in items)

    store.failures = 10
    with pytest.raises(ReadTimeoutError):  # the listing resumes after what it handed over, or stops the run
        list(parquet_items(store, ref, None))

    store.failures, broken = 0, {"b.parquet": b"not parquet at all" * 10}
    store.objects.update(broken)
    [item] = parquet_items(store, ObjectRef("b.parquet", 180, "e"), None)
    assert item.problem and "unreadable" in item.problem  # damage: a final bad_input record


def test_a_tar_whose_reads_fail_is_raised_not_damage():
    from vlm_caption.tasks.sources.webdataset import tar_items
    from tests.test_webdataset_source import shard_bytes

    data = shard_bytes(0, 3)
    store = FlakyStorage({"0.tar": data}, _error("SlowDown", 503), failures=1)
    with pytest.raises(ClientError):
        list(tar_items(store, ObjectRef("0.tar", len(data), "e"), "image"))
    items = list(itertools.islice(tar_items(store, ObjectRef("0.tar", len(data), "e"), "image"), 10))
    assert len(items) == 3 and not any(item.problem for item in items)
