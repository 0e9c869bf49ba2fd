"""A nightly rerun over a history costs what is new: with nothing new it makes no per-shard task
run and builds no engine, and a few new items among many done ones make one full shard; objects
after the greatest key the last listing read have the next run build its engine first. The
history is synthesized by `vlm-caption bench --history`'s own code (bench/history.py), so
this also checks that what the bench writes is what a run counts as done."""

from __future__ import annotations

import json
from collections import Counter

import pytest

import vlm_caption.flows.feed_schedule
import vlm_caption.flows.pipeline

import vlm_caption.flows.plan
from vlm_caption import flows
import vlm_caption.tasks.engine.vllm_engine as vllm_engine
from vlm_caption.bench.config import BenchConfig
from vlm_caption.bench.history import Locations, add_new_items, item_key, small_jpeg, synthesize
from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.params import CaptionJob
from vlm_caption.flows.plan import make_plan, start_engine_first
from tests.result_files import records as result_records

HISTORY, SHARD = 300, 8
PER_SHARD_TASKS = {"caption-batch", "start-engine"}  # the shards' task runs: a batch of them each


def task_runs(flow_run_id, completed: bool = False) -> Counter:
    """The flow run's task runs by name, each asserted ended in the server (`completed`: COMPLETED)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        ended = [run.state.is_completed() if completed else run.state.is_final() for run in runs]
        assert all(ended), [(run.name, run.state.type) for run in runs]
    return Counter(run.name.rsplit("-", 1)[0] for run in runs)


def _progress(flow_run_id) -> float:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return next(a.data for a in artifacts if a.key == "vlm-caption-progress")


def synthesized_history(model, tmp_path, size: int, shard: int):
    """A folder of `size` items all captioned already (the bench's history, as a run writes it),
    its new items' generator, and the job over it."""
    cfg = BenchConfig(workdir=str(tmp_path), history=size, shard_size=shard, max_tokens=4)
    where = Locations(tmp_path / "history", "folder")
    new = synthesize(where, cfg, str(model), {})
    job = CaptionJob(source=where.source, output=where.out, model=str(model), shard_size=shard,
                     sampling={"max_tokens": 4})
    return where, new, job


@pytest.fixture
def history(tiny_llava, tmp_path):
    return synthesized_history(tiny_llava, tmp_path, HISTORY, SHARD)


def test_a_night_with_nothing_new_then_one_with_a_few_new_items(prefect_api, history, monkeypatch):
    where, new, job = history
    built = []

    def no_engine(spec):
        built.append(spec)
        raise AssertionError("a run with nothing new built an engine")

    monkeypatch.setattr(vllm_engine, "_engine_for", no_engine)
    monkeypatch.setattr(flows.feed_schedule, "start_decode_pool", lambda modality: built.append(modality))

    state = vlm_caption(job, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert (summary["listed"], summary["skipped_already_done"], summary["processed"]) == (HISTORY, HISTORY, 0)
    flow_run_id = state.state_details.flow_run_id
    names = task_runs(flow_run_id)
    assert not PER_SHARD_TASKS & set(names), names  # 38 shards, all done: no task run for any
    assert names["list-source"] == 1 and sum(names.values()) <= 6, names
    assert built == []  # no engine, no decode pool
    assert _progress(flow_run_id) == 100.0  # the done items are the run's progress
    manifest = json.loads((where.base / "out" / "manifests" / f"{summary['run_id']}.json").read_text())
    assert manifest["counts"]["skipped_already_done"] == HISTORY and manifest["parts"] == []
    # The listing read the folder to its end: its greatest key is kept, and the next run looks past it
    # (tasks/sources/watermark.py): the night's items below sort among the done ones, so its engine
    # still waits for the listing to find them.
    (end,) = (where.base / "out" / "listed").glob("*.json")
    assert json.loads(end.read_text())["greatest_key"] == item_key(HISTORY - 1)
    first_builds = []  # what start_engine_first would build now, recorded instead
    monkeypatch.setattr(flows.plan, "build_engine_first", first_builds.append)
    assert not start_engine_first(make_plan(job)) and first_builds == []

    # Three new items, one between each hundred done ones: one full shard of them, nothing else.
    monkeypatch.undo()
    add_new_items(where, new, {})
    state = vlm_caption(job, return_state=True)
    summary = state.result()
    assert (summary["listed"], summary["skipped_already_done"], summary["processed"]) == (HISTORY + 3, HISTORY, 3)
    assert summary["succeeded"] == 3
    names = task_runs(state.state_details.flow_run_id)
    assert {name: names[name] for name in PER_SHARD_TASKS} == {"caption-batch": 1, "start-engine": 1}
    manifest = json.loads((where.base / "out" / "manifests" / f"{summary['run_id']}.json").read_text())
    assert len(manifest["parts"]) == 1  # the run's parts, folded into its view file at its end
    keys = sorted(r["key"] for r in result_records(where.base / "out") if r["run_id"] == summary["run_id"])
    assert keys == sorted(new)

    # An object that sorts after everything listed (a night's keys that begin with the day): the next
    # run builds its engine first, beside Prefect's start and the listing; one in the history's own
    # folder, before the greatest key, is left for the listing to find.
    (where.base / "src" / "d0000" / "00000001m.jpg").write_bytes(small_jpeg())
    monkeypatch.setattr(flows.plan, "build_engine_first", first_builds.append)
    assert not start_engine_first(make_plan(job)) and first_builds == []
    (where.base / "src" / "next-day").mkdir()
    (where.base / "src" / "next-day" / "a.jpg").write_bytes(small_jpeg())
    assert start_engine_first(make_plan(job)) and len(first_builds) == 1
