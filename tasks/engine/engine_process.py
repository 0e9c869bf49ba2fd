"""Waiting for an early engine's build to reach vLLM's engine process, before the caller takes
the GIL: the build's share in this process (the model's config and processor, vLLM's model
modules) is Python, and Prefect's import and server start run beside it stretch the engine's whole
start (docs/benchmarks.md), so `vlm-caption run` and the bench wait for it before importing Prefect.

What is watched is the operating system's view, not vLLM's objects: called right after the build
starts, before the run starts any process of its own (the decode pool, Prefect's embedded server),
a new child other than multiprocessing's resource tracker is the engine's.
"""

from __future__ import annotations

import os
import time

from vlm_caption.tasks.engine.vllm_engine import early_builds

POLL_S = 0.05
# The build's share of this process took 6.4 s where measured (docs/benchmarks.md): 30 s only
# bounds a build stuck before its engine process.
SPAWN_WAIT_S = 30.0


def wait_for_engine_process(timeout_s: float = SPAWN_WAIT_S) -> float:
    """Wait until the early engine build has started vLLM's engine process, has ended, or
    `timeout_s` has passed, so that a build that never starts one (stuck before it) holds the run
    back no longer; returns the seconds waited. Nothing is waited for without an early build, or
    for an engine that runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""
    builds = early_builds()
    if timeout_s <= 0 or not builds or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        return 0.0
    import psutil

    started, before = time.perf_counter(), {child.pid for child in psutil.Process().children()}
    while time.perf_counter() - started < timeout_s and not all(b.done() for b in builds):
        if any(_is_engine_process(child) for child in psutil.Process().children() if child.pid not in before):
            break
        time.sleep(POLL_S)
    return time.perf_counter() - started


def _is_engine_process(child) -> bool:
    """A new child other than multiprocessing's resource tracker (which starts with the first
    spawned process, before the engine's own)."""
    import psutil

    try:
        return "resource_tracker" not in " ".join(child.cmdline())
    except psutil.Error:  # gone already, or not ours to read: not the engine process
        return False
