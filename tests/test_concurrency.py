"""Two runs of the same job never duplicate records: a Prefect global concurrency limit named
after the job's fingerprint makes the second wait for the first (then skip what it did), and a
run that waits too long stops with a message that says what to do."""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest

from flows.caption import vlm_caption
from flows.params import CaptionJob
from tasks.concurrency import JobBusyError, one_run_per_job
from tests.images import image_bytes


def test_two_runs_of_one_job_started_together(prefect_api, tiny_llava, tmp_path, monkeypatch):
    source, out = tmp_path / "img", tmp_path / "out"
    source.mkdir()
    for i in range(12):
        (source / f"{i:02d}.png").write_bytes(image_bytes("PNG", size=(60 + i, 40), color=(i * 20, 0, 90)))
    job = CaptionJob(source=str(source), output=str(out), model=str(tiny_llava), shard_size=3,
                     sampling={"max_tokens": 4})
    summaries: list[dict] = []
    runs = [threading.Thread(target=lambda: summaries.append(vlm_caption(job))) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(timeout=900)
    assert len(summaries) == 2
    records = [json.loads(line) for part in out.glob("results/*/*.jsonl") for line in part.read_text().splitlines()]
    assert Counter(r["key"] for r in records) == Counter(f"{i:02d}.png" for i in range(12))  # none twice
    assert sorted(s["processed"] for s in summaries) == [0, 12]  # the second found it all done

    # While a run holds the job, another one waits, then gives up with a message.
    monkeypatch.setenv("VLM_CAPTION_JOB_WAIT_S", "2")
    from tasks.settings import get_settings

    get_settings.cache_clear()
    try:
        with one_run_per_job(summaries[0]["fingerprint"], str(out)):
            with pytest.raises(JobBusyError, match="another run of this job .* Wait for it, then run again"):
                vlm_caption(job)
    finally:
        get_settings.cache_clear()
