"""Waiting for an early engine's build to reach vLLM's engine process, before the caller takes
the GIL.

An engine built on a thread (`start_engine_early`) first does its share in this process (the
model's config and processor, vLLM's model modules: Python that needs the GIL), and only then
starts vLLM's engine process, where the long part (weights, compilation, the KV cache) happens.
Prefect's import and its embedded server's start are Python too: run beside that first share they
stretch it, and with it the whole start of the engine. So `vlm-caption run` and the bench wait for
the engine process to appear (or the build to end) before they import Prefect.

What is watched is the operating system's view (a new child process of this one), not vLLM's
objects. It is called right after the build starts, before the run starts any process of its own
(the decode pool, Prefect's embedded server), and long before the build gets to its engine process
(vLLM's model modules come first), so a new child other than multiprocessing's resource tracker is
the engine's.
"""

from __future__ import annotations

import os
import time

from vlm_caption.tasks.engine.vllm_engine import early_builds

POLL_S = 0.05
# The build's share of this process took 6.4 s where measured (docs/benchmarks.md): 30 s only
# bounds a build stuck before its engine process.
SPAWN_WAIT_S = 30.0


def children_now() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children()}


def engine_process_started(before: set[int]) -> bool:
    """A child process of this one, not among `before`, other than multiprocessing's resource
    tracker (which starts with the first spawned process, before the engine's own)."""
    import psutil

    for child in psutil.Process().children():
        if child.pid in before:
            continue
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:  # gone already, or not ours to read: not the engine process
            continue
        if "resource_tracker" not in command:
            return True
    return False


def wait_for_engine_process(timeout_s: float = SPAWN_WAIT_S) -> float:
    """Wait until the early engine build has started vLLM's engine process, has ended, or
    `timeout_s` has passed, so that a build that never starts one (stuck before it) holds the run
    back no longer; returns the seconds waited. Nothing is waited for without an early build, or
    for an engine that runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""
    builds = early_builds()
    if timeout_s <= 0 or not builds or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        return 0.0
    started, before = time.perf_counter(), children_now()
    while time.perf_counter() - started < timeout_s and not all(b.done() for b in builds):
        if engine_process_started(before):
            break
        time.sleep(POLL_S)
    return time.perf_counter() - started
