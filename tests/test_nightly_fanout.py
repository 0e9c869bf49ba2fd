"""A fanned-out nightly run over a history: with nothing new it learns so from its shard plan
before asking for any child, so it creates no child flow run (no worker process, no engine) and
reports every item done; with new items its children are asked for as before. The history is
synthesized by `vlm-caption bench --history`'s own code (bench/history.py)."""

from __future__ import annotations

import json
import threading

import pytest

import vlm_caption.flows.caption

import vlm_caption.flows.pipeline
from vlm_caption import flows
import vlm_caption.tasks.engine.vllm_engine as vllm_engine
from vlm_caption.bench.config import BenchConfig
from vlm_caption.bench.history import Locations, add_new_items, synthesize
from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.params import CaptionJob
from vlm_caption.tasks.results.layout import run_of
from tests.processes import idle_partition_deployment
from tests.result_files import records as result_records

HISTORY, SHARD = 200, 8
POOL, DEPLOYMENT = "nightly-no-workers", "partition-nightly"


@pytest.fixture(scope="module")
def partition_deployment(prefect_api) -> str:
    """A partition deployment on a work pool that no worker polls: a child the run asks for
    stays there until the parent takes it back (tasks/fanout.py)."""
    return idle_partition_deployment(DEPLOYMENT, POOL)


def _child_runs(output: str) -> list:
    """The flow runs of the partition deployment made for this output."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[DEPLOYMENT])))
    return [run for run in runs if (run.parameters.get("job") or {}).get("output") == output]


def test_a_fanned_out_night_with_nothing_new_starts_no_child(partition_deployment, tiny_llava, tmp_path, monkeypatch):
    cfg = BenchConfig(workdir=str(tmp_path), history=HISTORY, shard_size=SHARD, max_tokens=4)
    where = Locations(tmp_path / "history", "folder")
    new = synthesize(where, cfg, str(tiny_llava), {})
    job = CaptionJob(source=where.source, output=where.out, model=str(tiny_llava), shard_size=SHARD, fan_out=3,
                     partition_deployment=partition_deployment, sampling={"max_tokens": 4})

    def no_engine(spec):
        raise AssertionError("a run with nothing new built an engine")

    monkeypatch.setattr(vllm_engine, "_engine_for", no_engine)
    state = vlm_caption(job, return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert (summary["listed"], summary["skipped_already_done"], summary["processed"]) == (HISTORY, HISTORY, 0)
    assert _child_runs(where.out) == []  # no child flow run created
    manifest = json.loads((where.base / "out" / "manifests" / f"{summary['run_id']}.json").read_text())
    assert manifest["counts"]["skipped_already_done"] == HISTORY and manifest["parts"] == []
    assert [p for p in (where.base / "out" / "claims").rglob("*") if p.is_file()] == []  # the plan removed

    # Two new items: the children are asked for (no worker takes them: the parent does, finding
    # the shard captioned), and the new items are captioned once. Partition 0 waits to generate
    # until they are asked for: with this process's engine already built it could otherwise
    # caption both items before the watch's next look at the shard plan, and then, as it should,
    # start no child.
    monkeypatch.undo()
    add_new_items(where, new, {})
    asked = threading.Event()

    def start_children(*args, **kwargs):
        try:
            return starting(*args, **kwargs)
        finally:
            asked.set()

    def generate(self, prepared, last):
        assert asked.wait(60), "the children were not asked for at the shard plan's first shard"
        return generating(self, prepared, last)

    starting, generating = flows.caption.start_children, flows.batches.ShardPipeline.generate
    monkeypatch.setattr(flows.caption, "start_children", start_children)
    monkeypatch.setattr(flows.batches.ShardPipeline, "generate", generate)
    summary = vlm_caption(job)
    assert (summary["listed"], summary["skipped_already_done"], summary["processed"]) == (HISTORY + 2, HISTORY, 2)
    assert len(_child_runs(where.out)) == 2
    manifest = json.loads((where.base / "out" / "manifests" / f"{summary['run_id']}.json").read_text())
    assert sorted(p["index"] for p in manifest["partitions"]) == [0, 1, 2]
    records = [r for r in result_records(where.base / "out") if run_of(r["run_id"]) == summary["run_id"]]
    assert sorted(r["key"] for r in records) == sorted(new)
