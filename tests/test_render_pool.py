"""vLLM's request rendering in a pool of processes (tasks/engine/render.py), with real vLLM on
CPU and the tiny LLaVA: the flow's records are the same, token for token, as when the engine's
own process renders; each item gives one record at shard sizes 1 and 7; a prompt too long for
the context and an image that does not decode stay the errors of their own items."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from flows.caption import vlm_caption
from flows.params import CaptionJob
from recipes import get_recipe
from tasks.engine.arguments import EngineSpec
from tasks.engine.vllm_engine import get_engine, release_engines
from tasks.settings import get_settings
from tests.images import image_bytes


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for part in sorted(out.glob("results/*/*.jsonl"))
            for line in part.read_text().splitlines() if line]


def _manifest(out: Path) -> dict:
    (path,) = out.glob("manifests/*.json")
    return json.loads(path.read_text())


@pytest.fixture
def render_processes(monkeypatch):
    """Engines built inside the test render with `n` processes; the process's engine is let go
    when `n` changes and after the test, so no other test gets one built with this setting."""
    def use(n: int) -> None:
        if get_settings().render_processes != n:
            release_engines()
            monkeypatch.setenv("VLM_CAPTION_RENDER_PROCESSES", str(n))
            get_settings.cache_clear()

    yield use
    release_engines()
    monkeypatch.delenv("VLM_CAPTION_RENDER_PROCESSES", raising=False)
    get_settings.cache_clear()


def _job_folder(root: Path) -> Path:
    root.mkdir()
    lines = []
    for i in range(9):
        (root / f"{i}.jpg").write_bytes(image_bytes(size=(90 + 7 * i, 60 + 3 * i), color=(i * 25, 90, 200 - i * 9)))
        question = "dog cat " * 3000 if i == 4 else "What is in the picture ?"  # ~6000 tokens > 2048
        lines.append({"id": f"item{i}", "media": [f"{i}.jpg"], "question": question})
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")
    lines.append({"id": "broken", "media": ["broken.jpg"], "question": "What is in the picture ?"})
    (root / "jobs.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    return root / "jobs.jsonl"


def test_pool_rendering_gives_the_same_records_and_keeps_errors_per_item(prefect_api, tiny_llava, tmp_path,
                                                                        render_processes):
    manifest = _job_folder(tmp_path / "media")
    texts = {}
    for processes, shard_size in ((1, 1), (1, 7), (0, 7)):
        render_processes(processes)
        engine = get_engine(EngineSpec.build(get_recipe("llava"), model=str(tiny_llava)))  # the spec the flow builds
        submitted = engine._render_pool.submitted if processes else 0
        deadline = time.time() + 300
        while processes and not engine._render_pool.ready and time.time() < deadline:
            time.sleep(0.5)  # until then the feed renders in-process; this test wants the pool
        out = tmp_path / f"out-{processes}-{shard_size}"
        summary = vlm_caption(CaptionJob(manifest=str(manifest), output=str(out), model=str(tiny_llava),
                                         shard_size=shard_size, sampling={"max_tokens": 6}))
        by_id = {r["key"]: r for r in _records(out)}
        assert len(_records(out)) == len(by_id) == 10  # one record per item, none twice
        assert by_id["item4"]["error"]["kind"] == "generate"
        assert "maximum context length" in by_id["item4"]["error"]["message"]
        assert by_id["broken"]["error"]["kind"] == "decode"
        assert summary["succeeded"] == 8 and summary["failed"] == 2
        texts[(processes, shard_size)] = {k: r["text"] for k, r in by_id.items() if r["error"] is None}
        assert _manifest(out)["engine"]["sizing"]["render_processes"] == processes
        if processes:
            assert engine._render_pool.submitted - submitted == 9  # rendered by the pool, not in this process
    assert texts[(1, 1)] == texts[(1, 7)] == texts[(0, 7)]  # greedy: the same tokens either way
