"""What the project relies on in vLLM beyond its public API (tasks/engine/vllm_api.py), checked
against the installed vLLM, so that an upgrade that changes any of it fails here, by name, rather
than in a run: the engine arguments recorded for vLLM 0.26.0, the engine-core client's shutdown,
its dead flag and the queue a waiting `step()` reads, and `EngineDeadError`."""

from __future__ import annotations

import dataclasses
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tasks.engine import vllm_api
from tests.processes import engine_core_pids


def test_the_recorded_engine_arguments_are_the_installed_vllms():
    """A misspelled `--engine-arg` is refused from the names recorded for vLLM 0.26.0: they must be
    exactly `EngineArgs`' fields. After an upgrade, record them again (`RECORDED_VERSION` too)."""
    from vllm.engine.arg_utils import EngineArgs

    assert vllm_api.installed_version() == vllm_api.RECORDED_VERSION, "record this vLLM's EngineArgs fields"
    fields, recorded = {field.name for field in dataclasses.fields(EngineArgs)}, vllm_api.ENGINE_ARGUMENTS
    assert fields == recorded, f"EngineArgs gained {sorted(fields - recorded)} and lost {sorted(recorded - fields)}"


CHECK_OVERRIDES = """
import sys
from recipes import RecipeError
from tasks.engine import vllm_api
from tasks.engine.arguments import check_engine_overrides

def refusal(**check):
    try:
        check_engine_overrides({"max_model_length": 4096}, **check)
    except RecipeError as error:
        return str(error)

print(refusal(), "vllm" in sys.modules)
vllm_api.installed_version = lambda: "0.0.1"  # a release whose arguments are not recorded
print(refusal(), "vllm" in sys.modules)
print(refusal(import_vllm=True), "vllm" in sys.modules)
"""


def test_a_misspelled_engine_argument_is_refused_before_vllm_is_imported():
    """The pinned release's names answer at once; another release's are checked once vLLM is
    imported (where the engine is built), never guessed."""
    run = subprocess.run([sys.executable, "-c", CHECK_OVERRIDES], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert run.returncode == 0, run.stderr[-3000:]
    recorded, unrecorded, imported = [line for line in run.stdout.splitlines()  # vLLM logs to stdout too
                                      if line.startswith(("unknown vLLM engine argument", "None "))]
    hint = "unknown vLLM engine argument 'max_model_length'. Did you mean: max_model_len"
    assert recorded.startswith(hint) and recorded.endswith(" False")  # refused, vLLM not imported
    assert unrecorded == "None False"  # left to the engine's build
    assert imported.startswith(hint) and imported.endswith(" True")


def test_the_engine_core_client_still_has_what_the_feed_reads():
    """By name, without an engine: `LLM.llm_engine`, `LLMEngine.engine_core`, whose `step()` waits
    on `outputs_queue`; the client's `resources.engine_dead`, `shutdown(timeout)`, and the
    `EngineDeadError` it raises once the engine is dead."""
    from vllm import LLM
    from vllm.v1.engine import core_client, exceptions
    from vllm.v1.engine.llm_engine import LLMEngine

    def names(function) -> set[str]:  # the attributes and globals its code reads or sets
        return set(inspect.unwrap(function).__code__.co_names)

    assert {"llm_engine", "renderer"} <= names(LLM.__init__)
    assert "engine_core" in names(LLMEngine.__init__)
    assert {"engine_core", "get_output"} <= names(LLMEngine.step)
    assert "outputs_queue" in names(core_client.SyncMPClient.__init__)
    assert "outputs_queue" in names(core_client.SyncMPClient.get_output)
    assert "resources" in names(core_client.MPClient.__init__)
    assert "engine_dead" in {field.name for field in dataclasses.fields(core_client.BackgroundResources)}
    assert "timeout" in inspect.signature(core_client.MPClient.shutdown).parameters
    assert core_client.EngineDeadError is exceptions.EngineDeadError
    assert vllm_api.is_dead_engine_error(exceptions.EngineDeadError())
    assert not vllm_api.is_dead_engine_error(RuntimeError("a request's own error"))



@pytest.fixture
def engine_in_its_own_process(tiny_llava, monkeypatch):
    """A tiny engine whose core runs in a process of its own, as on a GPU (the suite runs them
    in-process, tests/conftest.py); vLLM caches its settings, so the cache is dropped around it."""
    import vllm.envs
    from vllm import LLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    vllm.envs.disable_envs_cache()
    llm = LLM(model=str(tiny_llava), enforce_eager=True, skip_mm_profiling=True, max_model_len=1024,
              kv_cache_memory_bytes=256 * 1024**2)
    yield llm
    vllm_api.shutdown_engine(llm, timeout=20)
    monkeypatch.undo()
    vllm.envs.disable_envs_cache()


def test_a_step_waiting_on_a_killed_engine_process_is_woken_by_the_adapter(engine_in_its_own_process):
    """vLLM 0.26 leaves a `step()` waiting forever once its engine process dies; the adapter sees
    the death and wakes that step, which raises `EngineDeadError` (the feed's watchdog). If vLLM
    starts waking it by itself, the watchdog can go: this test then fails at "still waiting"."""
    from vllm import SamplingParams

    llm = engine_in_its_own_process
    died, wake = vllm_api.engine_process_watch(llm)
    llm.llm_engine.add_request("long", "a b c", SamplingParams(max_tokens=900, ignore_eos=True))
    llm.llm_engine.step()  # the engine answers while its process lives
    assert not died()
    raised: list[BaseException] = []

    def step_until_it_raises():
        try:
            while True:
                llm.llm_engine.step()
        except BaseException as error:  # noqa: BLE001 - what the waiting step raised
            raised.append(error)

    stepping = threading.Thread(target=step_until_it_raises, daemon=True)
    stepping.start()
    for pid in engine_core_pids():
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not died() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert died(), "vLLM's client did not mark the killed engine process dead"
    stepping.join(timeout=5)
    assert stepping.is_alive() and not raised, f"still waiting: vLLM now wakes the step by itself ({raised})"
    wake(RuntimeError("the engine process died"))
    stepping.join(timeout=30)
    assert raised and vllm_api.is_dead_engine_error(raised[0])
    vllm_api.shutdown_engine(llm, timeout=20)  # a dead engine's shutdown returns
