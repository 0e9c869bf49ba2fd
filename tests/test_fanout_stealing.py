"""Fan-out with fewer live workers than partitions: a child that no worker has started is
claimed by the parent (the same PENDING claim a worker makes, so never both) and captioned on
the parent's engine. With no worker at all besides the parent, `fan_out=3` still completes,
every object once. A child that died left no report: the manifest counts what it wrote."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.params import CaptionJob
from vlm_caption.tasks.fanout import ChildRun, claim_unstarted
from tests.images import image_bytes
from tests.processes import idle_partition_deployment as create_idle_partition_deployment
from tests.result_files import records as result_records



@pytest.fixture(scope="module")
def idle_partition_deployment(prefect_api) -> str:
    return create_idle_partition_deployment("partition-idle")


def _child(deployment: str) -> ChildRun:
    from prefect.deployments import run_deployment

    run = run_deployment(deployment, parameters={"job": {}}, timeout=0)
    return ChildRun(1, str(run.id), run.name)


def test_claim_is_exclusive_with_a_worker(idle_partition_deployment):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import Pending

    with get_client(sync_client=True) as client:
        picked = _child(idle_partition_deployment)
        assert client.set_flow_run_state(picked.flow_run_id, Pending()).status == SetStateStatus.ACCEPT  # a worker
        assert not claim_unstarted(client, picked)  # the worker has it: the parent keeps off
        assert client.read_flow_run(picked.flow_run_id).state.is_pending()

        waiting = _child(idle_partition_deployment)
        assert claim_unstarted(client, waiting)
        state = client.read_flow_run(waiting.flow_run_id).state
        assert state.is_cancelled() and "parent run captions it" in state.message
        # a worker that polls now cannot start it any more
        assert client.set_flow_run_state(waiting.flow_run_id, Pending()).status != SetStateStatus.ACCEPT


def test_fan_out_with_no_free_worker_completes(idle_partition_deployment, tiny_llava, tmp_path, monkeypatch):
    """...and the source is listed once for the three partitions (the shard plan), and the run's
    claims are gone when it has finished."""
    import vlm_caption.tasks.sources.listing as listing

    listings, iter_items = [], listing.iter_items
    monkeypatch.setattr(listing, "iter_items", lambda source, *read: listings.append(source.uri) or iter_items(source, *read))
    source, out = tmp_path / "img", tmp_path / "out"
    source.mkdir()
    keys = [f"{i:02d}.png" for i in range(9)]
    for i, key in enumerate(keys):
        (source / key).write_bytes(image_bytes("PNG", size=(50 + i, 40), color=(i * 25, 60, 90)))
    job = CaptionJob(source=str(source), output=str(out), model=str(tiny_llava), shard_size=2, fan_out=3,
                     partition_deployment=idle_partition_deployment, sampling={"max_tokens": 4})
    summary = vlm_caption(job)

    records = result_records(out)
    assert Counter(r["key"] for r in records) == Counter(keys)  # every object once
    assert all(r["error"] is None for r in records)
    manifest = json.loads((out / "manifests" / f"{summary['run_id']}.json").read_text())
    assert sorted(p["index"] for p in manifest["partitions"]) == [0, 1, 2]
    assert {p["state"] for p in manifest["partitions"]} == {"COMPLETED"}
    assert manifest["counts"]["processed"] == len(keys)
    sizing = manifest["engine"]["sizing"]  # how vLLM sized the engine for the device present
    assert sizing["device"] == "cpu" and sizing["max_num_seqs"] > 0 and sizing["kv_cache_tokens"] > 0
    assert sizing["processor_device"] == "cpu" and sizing["processor_device_reason"] == "no GPU on this machine"
    assert {r["run_id"].rsplit("-", 1)[1] for r in records} <= {"p0", "p1", "p2"}
    assert listings == [str(source)]  # one listing, read by the three partitions through the plan
    assert [p for p in (out / "claims").rglob("*") if p.is_file()] == []  # the run's claims removed


def test_a_parent_that_fails_calls_off_the_children_no_worker_started(idle_partition_deployment, tmp_path,
                                                                      monkeypatch):
    """The parent's own partition fails: it must not wait forever for children no worker will
    take. They are called off (CANCELLED, saying why) and the run fails with its own error."""
    import vlm_caption.flows.caption as _loaded  # noqa: F401 - binds no name `vlm_caption` (the flow has it)
    from vlm_caption import flows
    from prefect.client.orchestration import get_client
    from vlm_caption.tasks.fanout import CALLED_OFF

    def fail(run):
        raise RuntimeError("partition 0 broke")

    monkeypatch.setattr(flows.caption, "caption_shards", fail)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(image_bytes("PNG"))
    job = CaptionJob(source=str(tmp_path / "img"), output=str(tmp_path / "out"), model="any", skip_model_check=True, fan_out=3,
                     partition_deployment=idle_partition_deployment)
    with pytest.raises(RuntimeError, match="partition 0 broke"):
        vlm_caption(job)
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with get_client(sync_client=True) as client:  # the children: runs of the idle partition deployment
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(
            name=DeploymentFilterName(any_=[idle_partition_deployment.split("/", 1)[1]])))
    called_off = [r for r in runs if r.state and r.state.message == CALLED_OFF
                  and (r.parameters.get("job") or {}).get("output") == str(tmp_path / "out")]
    assert len(called_off) == 2 and all(r.state.is_cancelled() for r in called_off)


def test_the_manifest_counts_what_a_child_that_left_no_report_had_written(tmp_path, monkeypatch):
    """Child 2 was killed after writing two shards' parts: shard 3's done mark landed, shard 5's
    did not (it was retaken; the retaker found its items done and listed them). Its records count
    as processed, shard 3's items as listed, and its parts are the run's (the Parquet view's)."""
    from types import SimpleNamespace

    from vlm_caption.flows import caption as caption_flow
    from vlm_caption.tasks.observability import get_logger
    from vlm_caption.tasks.records import ResultRecord
    from vlm_caption.tasks.results.layout import partition_parts_id
    from vlm_caption.tasks.results.report import PartitionReport, RunStats
    from vlm_caption.tasks.results.writers import read_partition_reports, write_partition_report, write_shard
    from vlm_caption.tasks.sources.storage import LocalStorage

    out = LocalStorage(tmp_path / "out", create=True)
    write_partition_report.fn(out, "run1", PartitionReport(index=1, listed=4, processed=4, succeeded=4))

    def record(key: str, error: dict | None = None) -> ResultRecord:
        return ResultRecord(key=key, size=1, etag="e", sha256=None, recipe="r", model="m", question="q", prompt=None,
                            text=None if error else "a caption", finish_reason="stop", error=error, timings={},
                            fingerprint="fp", run_id=partition_parts_id("run1", 2))

    failed = {"kind": "decode", "message": "not an image", "retryable": False}
    write_shard(out, "fp", partition_parts_id("run1", 2), 3, [record("c.jpg"), record("d.jpg", failed)], "src/",
                "claims/run1/000003.done")
    write_shard(out, "fp", partition_parts_id("run1", 2), 5, [record("e.jpg"), record("f.jpg")], "src/")
    out.write("claims/run1/000005.r1", b"{}")
    monkeypatch.setattr(caption_flow, "wait_for_children", lambda children, run_here: {1: "COMPLETED", 2: "CRASHED"})
    monkeypatch.setattr(caption_flow, "read_partition_reports", read_partition_reports.fn)
    run = SimpleNamespace(output=out, run_id="run1", fingerprint="fp", log=get_logger())
    stats = RunStats()
    merged = caption_flow.merge_children(run, [ChildRun(1, "flow-1", "c1"), ChildRun(2, "flow-2", "c2")], stats)

    assert (stats.processed, stats.succeeded, stats.failed, stats.listed) == (4 + 4, 4 + 3, 1, 4 + 2)
    dead = merged[1]
    assert "no report" in dead.state and dead.flow_run_id == "flow-2" and len(dead.parts) == 2
    assert sorted(stats.parts) == sorted(dead.parts) and stats.failures_by_kind == {"decode": 1}
