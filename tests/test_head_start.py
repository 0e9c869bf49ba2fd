"""A nightly run's head start (flows/head_start.py): `vlm-caption run` begins the done-index's
load and the listing before Prefect's server is up; the flow takes them instead of loading and
listing again, and shows the same task runs and counts. A head start another run may have
outdated (it ended meanwhile) is dropped and the flow loads again. A listing begun with no one
taking its shards yet does not wait on the done items it counts."""

from __future__ import annotations

import json
import time

import pytest

import vlm_caption.flows.head_start as head_start
import vlm_caption.flows.pipeline
from vlm_caption import flows
import vlm_caption.tasks.sources.formats as formats
from vlm_caption.bench.history import add_new_items
from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.plan import make_plan
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.items import ObjectRef
from vlm_caption.tasks.sources.listing import AlreadyDone, ShardStream
from tests.test_nightly import synthesized_history, task_runs

HISTORY, SHARD = 200, 8


class Keys:
    """A bucket of `count` keys, listed lazily."""

    def __init__(self, count: int):
        self.count = count

    def iter_objects(self, glob=None, prefix=""):
        for i in range(self.count):
            yield ObjectRef(f"img/{i:07d}.jpg", 1000 + i, f"etag-{i}")


def test_a_begun_listing_of_done_items_ends_before_anyone_takes_them(monkeypatch):
    monkeypatch.setattr(formats, "source_storage", lambda uri, follow_links=False: Keys(20_000))
    stream = ShardStream(SourceSpec("s3://synthetic/"), 64, None, pending=lambda items: [False] * len(items))
    stream.begin()
    for _ in range(600):  # no one reads: 20 batches of done items, a queue of 4
        if stream.finished:
            break
        time.sleep(0.05)
    assert stream.finished  # every item judged: only its end waits for a reader
    listed = list(stream)
    assert all(isinstance(x, AlreadyDone) for x in listed) and sum(x.items for x in listed) == 20_000


def test_a_begun_listing_hands_done_counts_before_the_shard_after_them(monkeypatch):
    monkeypatch.setattr(formats, "source_storage", lambda uri, follow_links=False: Keys(10_000))
    # only the last item has work left: its shard comes after every done item's count
    stream = ShardStream(SourceSpec("s3://synthetic/"), 64, None,
                         pending=lambda items: [item.id == "img/0009999.jpg" for item in items])
    stream.begin()
    listed = list(stream)
    assert sum(x.items for x in listed[:-1] if isinstance(x, AlreadyDone)) == 9_999
    assert [item.id for item in listed[-1].items] == ["img/0009999.jpg"]


@pytest.fixture
def history(tiny_llava, tmp_path):
    return synthesized_history(tiny_llava, tmp_path, HISTORY, SHARD)


def _loads(monkeypatch) -> list:
    """The flow's own loads of the done-index (none when it took the head start's)."""
    loads, load = [], flows.pipeline.load_done_index
    monkeypatch.setattr(flows.pipeline, "load_done_index", lambda *a: loads.append(a) or load(*a))
    return loads


def test_the_flow_takes_the_begun_load_and_listing(prefect_api, history, monkeypatch):
    where, new, job = history
    add_new_items(where, new, {})  # two new items among the done ones
    loads = _loads(monkeypatch)
    monkeypatch.setattr(head_start, "SLOT_FREE_S", 600.0)  # a busy machine's slow server is not another run
    plan = make_plan(job)
    assert head_start.begin_head_start(plan)
    state = vlm_caption(plan.job, return_state=True)
    summary = state.result()
    assert loads == []  # the head start's index, not a second load
    assert (summary["listed"], summary["skipped_already_done"], summary["processed"]) == (HISTORY + 2, HISTORY, 2)
    assert summary["succeeded"] == 2
    names = task_runs(state.state_details.flow_run_id, completed=True)
    assert names["load-done-index"] == 1 and names["list-source"] == 1, names
    assert not head_start._started  # taken once


def test_a_head_start_outdated_by_a_run_that_ended_meanwhile_is_dropped(prefect_api, history, monkeypatch):
    where, _, job = history
    loads = _loads(monkeypatch)
    plan = make_plan(job)
    assert head_start.begin_head_start(plan)
    head = head_start._started
    head.loaded.wait(30)
    (where.base / "out" / "manifests" / "another-run.json").write_text(json.dumps({}))  # it ended just now
    summary = vlm_caption(plan.job)
    assert len(loads) == 1  # loaded again, after the job's slot was taken
    assert (summary["listed"], summary["skipped_already_done"], summary["processed"]) == (HISTORY, HISTORY, 0)
    assert not head_start._started


def test_a_job_resolved_otherwise_by_the_flow_does_not_take_it(prefect_api, history, monkeypatch):
    _, _, job = history
    loads = _loads(monkeypatch)
    plan = make_plan(job)
    assert head_start.begin_head_start(plan)
    summary = vlm_caption(job.model_copy(update={"shard_size": 16}))  # shards of another size: another listing
    assert len(loads) == 1 and summary["skipped_already_done"] == HISTORY
    assert not head_start._started  # dropped once the flow had resolved its own job


@pytest.mark.parametrize("etag", ["4d2-1f", "it's", 'say "hi"', "back\\slash", "ünï"])
def test_a_listed_items_signature_is_the_one_its_result_was_written_with(etag):
    from vlm_caption.tasks.results.done_index import listed_signature_hash
    from vlm_caption.tasks.results.done_rows import listing_signature, signature_hash
    from vlm_caption.tasks.sources.items import WorkItem

    one = WorkItem("a.jpg", (ObjectRef("a.jpg", 1234, etag),))
    two = WorkItem("g", (ObjectRef("g/1.jpg", 1, etag), ObjectRef("g/2.jpg", 2, "x")))
    for item in (one, two):
        assert listed_signature_hash(item) == signature_hash(listing_signature(item))
    assert listed_signature_hash(WorkItem("b.jpg", (ObjectRef("b.jpg", -1, etag),))) is None


def test_vlm_caption_run_over_a_history_takes_its_head_start(prefect_api, history, monkeypatch, capsys):
    from vlm_caption.flows.cli import main

    where, _, job = history
    loads = _loads(monkeypatch)
    monkeypatch.setattr(head_start, "SLOT_FREE_S", 600.0)
    begun = []
    monkeypatch.setattr(head_start, "begin_head_start",
                        lambda plan, begin=head_start.begin_head_start: begun.append(begin(plan)) or begun[-1])
    code = main(["run", where.source, "--model", job.model, "--out", where.out, "--shard-size", str(SHARD),
                 "--max-tokens", "4", "-v"])
    assert code == 0 and begun == [True]
    assert loads == []  # the flow took the load and the listing `vlm-caption run` began
    assert f"0 captioned: 0 ok, 0 failed; {HISTORY} already done" in capsys.readouterr().out
    assert not head_start._started
