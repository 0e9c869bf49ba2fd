"""`vlm-caption run` holds Prefect's start back until the engine it started first has reached
vLLM's engine process (tasks/engine/engine_process.py): waits for that child process, for the
build's end, or for its limit, and for nothing when there is nothing to wait for."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import pytest

from vlm_caption.tasks.engine import engine_process


@pytest.fixture
def build(monkeypatch):
    """An early engine build that has not ended, with engines in their own process."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    building: Future = Future()
    monkeypatch.setattr(engine_process, "early_builds", lambda: [building])
    return building


def test_it_waits_for_the_engine_process_to_start_then_goes_on(build):
    children: list[subprocess.Popen] = []

    def spawn_later() -> None:
        time.sleep(0.5)
        children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]))

    threading.Thread(target=spawn_later).start()
    try:
        waited = engine_process.wait_for_engine_process(timeout_s=20)
        assert children and children[0].poll() is None  # it went on once the process was there...
        assert 0.4 < waited < 15  # ...not before it, nor at its limit
    finally:
        for child in children:
            child.kill()


def test_a_build_that_ends_without_a_process_ends_the_wait(build):
    threading.Timer(0.3, lambda: build.set_exception(RuntimeError("model not loadable"))).start()
    assert engine_process.wait_for_engine_process(timeout_s=20) < 15


def test_a_build_that_never_gets_there_is_waited_for_no_longer_than_the_limit(build):
    assert 0.9 <= engine_process.wait_for_engine_process(timeout_s=1.0) < 10


def test_nothing_is_waited_for_without_a_build_an_engine_process_or_a_limit(build, monkeypatch):
    assert engine_process.wait_for_engine_process(timeout_s=0) == 0.0
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine runs in this process
    assert engine_process.wait_for_engine_process(timeout_s=20) == 0.0
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    monkeypatch.setattr(engine_process, "early_builds", lambda: [])
    assert engine_process.wait_for_engine_process(timeout_s=20) == 0.0
