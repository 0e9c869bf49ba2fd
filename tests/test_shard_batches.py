"""Prefect sees a run's shards a batch at a time (flows/batches.py): one `caption-batch`
task run per batch of consecutive shards, the batches doubling from 1 shard up to a cap, so the
task runs stay in the thousands at 100M items. A batch's task run does its shards' work, and
a shard that fails is tried again by the batch's task retries; past them it makes its batch
Failed with its error, while its items are still written, as retryable error records that the
next run computes again (tiny LLaVA, vLLM on CPU, a real Prefect API)."""

from __future__ import annotations

import json
from collections import Counter

import vlm_caption.flows.batches as batches
from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.params import CaptionJob
from tests.images import image_bytes
from tests.result_files import records as result_records

IMAGES = 12


def test_task_runs_at_scale_are_a_few_thousand():
    def task_runs(items: int, shard_size: int) -> int:
        shards, number = -(-items // shard_size), 0
        while shards > 0:
            number += 1
            shards -= batches.batch_size(number, shard_size)
        return number

    assert [batches.batch_size(n, 64) for n in range(1, 12)] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 512]
    assert task_runs(100_000_000, 64) == 3_060  # was 3 per shard: 4,687,500
    assert task_runs(100_000_000, 1024) == 3_056  # the cap is in items: 32 shards of 1,024
    assert task_runs(1_000, 64) == 5  # a small run still shows several: 1, 2, 4, 8 and the last 1


def _task_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def _batch_lines(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return sorted((m for m in (log.message for log in logs) if m.startswith("batch done ")),
                  key=lambda line: int(line.split("batch=")[1].split()[0]))


def test_batches_grow_and_a_failed_shard_fails_its_batch_and_loses_nothing(prefect_api, tiny_llava, tmp_path,
                                                                           monkeypatch):
    source, out = tmp_path / "img", tmp_path / "out"
    source.mkdir()
    for i in range(IMAGES):
        (source / f"{i:02d}.jpg").write_bytes(image_bytes(size=(40 + i, 32), color=(i * 20, 80, 160)))
    monkeypatch.setattr(batches, "BATCH_ITEMS", 4)  # batches of 1, 2, 4, then 4 at most (shards of 1)
    tried, generate_shard = Counter(), batches.generate_shard

    def failing_shard_4(prepared, *args):
        tried[prepared.shard.index] += 1
        if prepared.shard.index == 4:
            raise RuntimeError("a fault the test put in shard 4")
        return generate_shard(prepared, *args)

    monkeypatch.setattr(batches, "generate_shard", failing_shard_4)
    job = CaptionJob(source=str(source), output=str(out), model=str(tiny_llava), shard_size=1,
                     sampling={"max_tokens": 2})
    state = vlm_caption(job, return_state=True)
    assert state.is_completed(), state.message  # the run goes on past a failed shard
    summary = state.result()
    flow_run_id = state.state_details.flow_run_id

    runs = _task_runs(flow_run_id)
    batch_runs = {run.name: run for run in runs if run.name.startswith("caption-batch-")}
    assert sorted(batch_runs) == [f"caption-batch-{n}" for n in range(1, 6)]  # 12 shards: 1 + 2 + 4 + 4 + 1
    assert not [run.name for run in runs if run.name.rsplit("-", 1)[0].endswith("-shard")]  # none per shard
    assert all(run.state.is_final() for run in runs), [(run.name, run.state.type) for run in runs]
    failed = batch_runs.pop("caption-batch-3")  # shards 3 to 6
    assert failed.state.is_failed() and "shard 4" in failed.state.message, failed.state.message
    assert failed.run_count == 1 + batches.BATCH_RETRIES  # Prefect's task retries did it again
    assert "a fault the test put in shard 4" in failed.state.message
    assert all(run.state.is_completed() for run in batch_runs.values())
    lines = _batch_lines(flow_run_id)
    assert [line.split("shards=")[1].split()[0] for line in lines] == ["1", "2", "4", "4", "1"]
    assert tried[4] == 1 + batches.BATCH_RETRIES and tried[3] == 1  # the failing shard tried again by its batch's retries

    # Every item written: the captions in the output's files, the failed one's retryable error in the
    # manifest's failures (a retryable record is not kept in a file once its run has folded its parts).
    records = result_records(out)
    assert sorted(r["key"] for r in records) == [f"{i:02d}.jpg" for i in range(IMAGES) if i != 4]
    failures = json.loads((out / "manifests" / f"{summary['run_id']}.json").read_text())["failures"]
    error = next(f for f in failures if f["key"] == "04.jpg")
    assert error["kind"] == "generate" and error["retryable"]
    assert "a fault the test put in shard 4" in error["message"]
    assert summary["failed"] == 1 and summary["succeeded"] == IMAGES - 1

    monkeypatch.setattr(batches, "generate_shard", generate_shard)
    again = vlm_caption(job)  # the failed item is not done: the next run computes it, and only it
    assert (again["skipped_already_done"], again["processed"], again["succeeded"]) == (IMAGES - 1, 1, 1)


def test_a_part_never_written_is_counted_as_write_failures_and_computed_by_the_next_run(prefect_api, tiny_llava,
                                                                                        tmp_path, monkeypatch):
    source, out = tmp_path / "img", tmp_path / "out"
    source.mkdir()
    for i in range(3):
        (source / f"{i:02d}.jpg").write_bytes(image_bytes(size=(40 + i, 32), color=(i * 60, 80, 160)))
    tried, write_shard = Counter(), batches.write_shard

    def failing_write_of_shard_1(out_, fingerprint, parts_id, index, records, *args):
        tried[index] += 1
        if index == 1:
            raise RuntimeError("a write fault the test put in shard 1")
        return write_shard(out_, fingerprint, parts_id, index, records, *args)

    monkeypatch.setattr(batches, "write_shard", failing_write_of_shard_1)
    job = CaptionJob(source=str(source), output=str(out), model=str(tiny_llava), shard_size=1,
                     sampling={"max_tokens": 2})
    state = vlm_caption(job, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert tried[1] == 1 + batches.BATCH_RETRIES and tried[0] == tried[2] == 1
    assert summary["failed_by_kind"] == {"write": 1} and summary["succeeded"] == 2, summary
    assert any(f["kind"] == "write" and "shard 1" in f["message"] for f in summary["failures"]), summary["failures"]
    failed = [run for run in _task_runs(state.state_details.flow_run_id) if run.state.is_failed()]
    assert [run.name for run in failed] == ["caption-batch-2"], failed  # shards 1 and 2; shard 1 never written
    assert sorted(r["key"] for r in result_records(out)) == ["00.jpg", "02.jpg"]

    monkeypatch.setattr(batches, "write_shard", write_shard)
    again = vlm_caption(job)  # not on the done-index: computed again, and only it
    assert (again["skipped_already_done"], again["processed"], again["succeeded"]) == (2, 1, 1)
