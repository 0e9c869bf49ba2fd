"""Engine faults through the flow (tiny LLaVA, vLLM on CPU): a request the engine rejects is
that item's error record while the rest of its shard is captioned; an engine process killed in
the middle of a run is replaced, its shards are redone, and no record is duplicated."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter

import pytest

from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.params import CaptionJob
from vlm_caption.tasks.engine.vllm_engine import release_engines
from tests.images import image_bytes
from tests.processes import engine_core_pids
from tests.result_files import records as _records


@pytest.fixture(scope="module", autouse=True)
def engines_in_their_own_process():
    """vLLM's engine core in a process of its own, as on a GPU: this module kills that process
    (the suite runs tiny engines in-process, tests/conftest.py). vLLM caches its settings once an
    engine starts, so the cache is dropped around the module, and so is any engine made without."""
    import vllm.envs

    release_engines()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        vllm.envs.disable_envs_cache()
        yield
        release_engines()
    vllm.envs.disable_envs_cache()


def test_a_prompt_longer_than_the_context_fails_alone(prefect_api, tiny_llava, tmp_path):
    (tmp_path / "img").mkdir()
    lines = []
    for i in range(4):
        (tmp_path / "img" / f"{i}.jpg").write_bytes(image_bytes(size=(80 + i, 60), color=(i * 40, 90, 20)))
        question = "dog cat " * 3000 if i == 2 else "What is in the picture ?"  # ~6000 tokens > 2048
        lines.append(json.dumps({"id": f"item{i}", "media": [f"img/{i}.jpg"], "question": question}))
    (tmp_path / "jobs.jsonl").write_text("\n".join(lines))
    summary = vlm_caption(CaptionJob(manifest=str(tmp_path / "jobs.jsonl"), output=str(tmp_path / "out"),
                                     model=str(tiny_llava), shard_size=4, sampling={"max_tokens": 4}))
    by_id = {r["key"]: r for r in _records(tmp_path / "out")}
    assert sorted(by_id) == ["item0", "item1", "item2", "item3"]
    assert by_id["item2"]["error"]["kind"] == "generate" and "longer than the maximum model length" in by_id["item2"]["error"]["message"]
    assert all(by_id[k]["error"] is None and by_id[k]["output_tokens"] > 0 for k in ("item0", "item1", "item3"))
    assert summary["succeeded"] == 3 and summary["failed"] == 1



def test_an_engine_killed_mid_run_is_replaced_and_nothing_is_duplicated(prefect_api, tiny_llava, tmp_path):
    source, out = tmp_path / "img", tmp_path / "out"
    source.mkdir()
    for i in range(60):
        (source / f"{i:02d}.jpg").write_bytes(image_bytes(size=(64 + i, 48), color=(i * 4, 100, 200 - i)))
    killed: list[int] = []

    def kill_once_the_first_part_is_written():
        deadline = time.time() + 600
        while time.time() < deadline and not killed:
            if list(out.glob("parquet/*/part-*.parquet")):
                for pid in engine_core_pids():
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_once_the_first_part_is_written, daemon=True)
    watcher.start()
    state = vlm_caption(CaptionJob(source=str(source), output=str(out), model=str(tiny_llava), shard_size=4,
                                   sampling={"max_tokens": 48, "ignore_eos": True}), return_state=True)
    watcher.join(timeout=5)
    assert killed, "the engine finished before it could be killed"
    assert state.is_completed(), state.message
    records = _records(out)
    assert Counter(r["key"] for r in records) == Counter(f"{i:02d}.jpg" for i in range(60))  # each once
    assert all(r["error"] is None for r in records)
    assert not set(killed) & set(engine_core_pids())  # a new engine, not the killed one
