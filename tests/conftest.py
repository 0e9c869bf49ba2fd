from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("VLM_CAPTION_LOG_FORMAT", "json")

from tests.checkpoints import build_checkpoint  # noqa: E402

pytest_plugins = ["tests.postgres"]  # the session's PostgreSQL and Prefect server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def release_engines_at_the_end():
    """The flows run in this process leave its engine up; it is shut down while the test
    session's output is still open (the exit hook would log into closed streams)."""
    yield
    if "tasks.engine.vllm_engine" in sys.modules:
        sys.modules["tasks.engine.vllm_engine"].release_engines()


@pytest.fixture(scope="session")
def checkpoints_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny_llava(checkpoints_root) -> Path:
    return build_checkpoint("llava", checkpoints_root)


@pytest.fixture(scope="session")
def prefect_api():
    """A real, temporary Prefect API (SQLite) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's standalone S3 server on loopback, reached over real HTTP by boto3."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError("moto server did not start")
    env = {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1", "VLM_CAPTION_S3_ENDPOINT_URL": url,
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from tasks.settings import get_settings

    get_settings.cache_clear()
    yield url
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    get_settings.cache_clear()
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def s3_client(s3_endpoint):
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint)
