import pytest
from pydantic import ValidationError

from vlm_caption.flows.params import CaptionJob
from vlm_caption.tasks.results.done_index import DoneIndex
from tests.result_files import index_rows
from vlm_caption.tasks.records import ResultRecord, job_fingerprint
from vlm_caption.tasks.sources.items import ObjectRef, WorkItem


def test_fingerprint_changes_with_source_sampling_model_recipe_modality_but_not_question():
    base = dict(source="s3://b/images/", recipe="llava", model="m", modality="image", method="generate",
                media={}, sampling={"temperature": 0.0})
    fp = job_fingerprint(**base)
    assert fp == job_fingerprint(**base)
    assert job_fingerprint(**{**base, "source": "s3://b/images"}) == fp  # a trailing slash is the same place
    for change in ({"source": "s3://b/more/"}, {"model": "n"}, {"recipe": "x"}, {"sampling": {"temperature": 0.5}},
                   {"modality": "video"}, {"method": "chat"}, {"media": {"num_frames": 8}}, {"retry_looping": 1.3},
                   {"dedup": False}):
        assert job_fingerprint(**{**base, **change}) != fp
    assert job_fingerprint(**base, retry_looping=None, dedup=True) == fp  # the defaults: as before they existed


def _record(key="a.jpg", question="q", size=10, etag="e1", sha="sha", members=None, error=None):
    return ResultRecord(key=key, size=size, etag=etag, sha256=sha, recipe="llava", model="m", question=question,
                        prompt=None, text="t", finish_reason="stop", members=members, error=error, timings={},
                        fingerprint="f", run_id="r")


def test_done_means_same_item_question_and_members():
    done = DoneIndex([index_rows([_record()])])
    item = WorkItem("a.jpg", (ObjectRef("a.jpg", 10, "e1"),))
    assert done.pending_by_listing(item, ("q",)) == ()
    assert done.pending_by_listing(item, ("q", "new")) == ("new",)  # a question added later
    assert done.pending_by_listing(WorkItem("a.jpg", (ObjectRef("a.jpg", 11, "e1"),)), ("q",)) == ("q",)
    assert done.pending_by_listing(WorkItem("a.jpg", (ObjectRef("a.jpg", 10, "e2"),)), ("q",)) == ("q",)
    assert done.pending_by_listing(WorkItem("b.jpg", (ObjectRef("b.jpg", 10, "e1"),)), ("q",)) == ("q",)
    # unknown etags (a manifest's URLs) are judged after the fetch, by content
    unlisted = WorkItem("a.jpg", (ObjectRef("https://h/a.jpg"),))
    assert done.pending_by_listing(unlisted, ("q",)) == ("q",)
    assert done.pending_by_content("a.jpg", "sha", ("q",)) == ()
    assert done.pending_by_content("a.jpg", "other", ("q",)) == ("q",)


def test_a_group_is_done_only_with_the_same_members():
    from vlm_caption.tasks.records import Member

    members = [Member(key="g/1.jpg", size=1, etag="a", sha256="s1"), Member(key="g/2.jpg", size=2, etag="b", sha256="s2")]
    done = DoneIndex([index_rows([_record(key="g", size=3, etag="", members=members)])])
    same = WorkItem("g", (ObjectRef("g/1.jpg", 1, "a"), ObjectRef("g/2.jpg", 2, "b")))
    grown = WorkItem("g", (*same.members, ObjectRef("g/3.jpg", 3, "c")))
    assert done.pending_by_listing(same, ("q",)) == ()
    assert done.pending_by_listing(grown, ("q",)) == ("q",)  # a new member makes it a new item


def test_retryable_errors_are_not_final():
    record = dict(key="k", size=1, etag="e", sha256=None, recipe="llava", model="m", prompt=None,
                  text=None, finish_reason=None, timings={}, fingerprint="f", run_id="r")
    assert ResultRecord(**record).is_final
    assert ResultRecord(**record, error={"kind": "decode", "message": "x", "retryable": False}).is_final
    assert not ResultRecord(**record, error={"kind": "fetch", "message": "x", "retryable": True}).is_final


def test_job_defaults_and_validation():
    job = CaptionJob(source="s3://b/in/", output="/tmp/out")
    assert job.recipe == "llava" and job.questions_to_ask[0].startswith("Describe") and job.shard_size == 64
    assert CaptionJob(source="/x", output="/o", question="Q?").questions == ["Q?"]  # the one-question form
    assert CaptionJob(source="/x", output="/o", questions=["a", "b", "a"]).questions == ["a", "b"]
    assert "video" in CaptionJob(source="/x", output="/o", recipe="qwen2_vl", modality="video").questions_to_ask[0]
    with pytest.raises(ValidationError, match="exactly one of `source`"):
        CaptionJob(output="/o")
    with pytest.raises(ValidationError, match="exactly one of `source`"):
        CaptionJob(source="/x", manifest="/m.jsonl", output="/o")
    with pytest.raises(ValidationError, match="use method 'generate' for video"):
        CaptionJob(source="/x", output="/o", recipe="qwen2_vl", modality="video", method="chat")
    with pytest.raises(ValidationError, match="unknown recipe 'lava'.*Did you mean: llava"):
        CaptionJob(source="s3://b/", output="s3://b/o", recipe="lava")
    with pytest.raises(ValidationError, match="does not support modality 'image'; it supports: video"):
        CaptionJob(source="s3://b/", output="s3://b/o", recipe="llava-next-video")
    with pytest.raises(ValidationError, match="unsupported scheme"):
        CaptionJob(source="http://b/", output="s3://b/o")
    with pytest.raises(ValidationError):
        CaptionJob(source="s3://b/", output="s3://b/o", sampling={"temperature": -1})
    with pytest.raises(ValidationError):
        CaptionJob(source="s3://b/", output="s3://b/o", shard_size=0)


def test_job_schema_is_a_form_prefect_can_render():
    from prefect import Flow
    from vlm_caption.flows.caption import vlm_caption

    assert isinstance(vlm_caption, Flow)
    schema = vlm_caption.parameters.model_dump()
    assert schema["required"] == ["job"]
    job_schema = schema["definitions"]["CaptionJob"]
    assert {"source", "manifest", "output", "recipe", "questions", "modality", "method", "num_frames",
            "max_images", "sampling", "shard_size"} <= set(job_schema["properties"])


def test_a_partition_run_cannot_fan_out_again():
    from vlm_caption.flows.params import Partition

    with pytest.raises(ValidationError, match="cannot fan out again"):
        CaptionJob(source="/tmp", output="/tmp/o", fan_out=2, partition=Partition(index=1, count=2, run_id="r"))
    with pytest.raises(ValidationError, match="out of range"):
        Partition(index=2, count=2, run_id="r")


def test_parent_absorbs_child_partition_reports():
    from vlm_caption.tasks.results.report import PartitionReport, RunStats

    stats = RunStats(listed=5, processed=5, succeeded=4, parts=["a"], failures_by_kind={"decode": 1})
    stats.absorb(PartitionReport(index=1, listed=7, processed=6, succeeded=6, skipped=1, parts=["b"],
                                 failures_by_kind={"decode": 2}, failures=[{"key": "x"}, {"key": "y"}]))
    assert (stats.listed, stats.processed, stats.succeeded, stats.skipped) == (12, 11, 10, 1)
    assert stats.failed == 3 and stats.parts == ["a", "b"] and len(stats.failures) == 2


def test_a_fanned_out_run_generates_over_the_span_of_its_partitions():
    """Two partitions generating 10 s each, side by side (one started 5 s later): the run's
    items/s while generating is theirs together over the 15 s they span, not over 20 GPU-seconds."""
    from vlm_caption.tasks.results.report import PartitionReport, RunStats

    stats = RunStats(processed=100, succeeded=100)
    stats.mark_generating(1000.0, 1010.0)
    child = PartitionReport(index=1, processed=100, succeeded=100)
    child.mark_generating(1005.0, 1015.0)
    stats.absorb(child)
    assert (stats.generate_from, stats.generate_to, stats.generate_s) == (1000.0, 1015.0, 15.0)
    assert stats.summary()["generate_items_per_s"] == round(200 / 15, 3)
    assert child.brief()["generate_items_per_s"] == 10.0
    assert stats.manifest(run_id="r", parameters={}, fingerprint="f", engine=None)["generate_window"] == [1000.0, 1015.0]


def test_the_command_line_sets_the_switches_that_change_records():
    from vlm_caption.flows.cli import build_parser
    from vlm_caption.flows.cli_job import job_fields

    run = ["run", "/in", "--out", "/out"]
    fields = job_fields(build_parser().parse_args([*run, "--retry-looping", "--no-dedup"]))
    assert (fields["retry_looping"], fields["dedup"]) == (1.3, False)
    assert job_fields(build_parser().parse_args([*run, "--retry-looping", "1.1"]))["retry_looping"] == 1.1
    assert {"retry_looping", "dedup"}.isdisjoint(job_fields(build_parser().parse_args(run)))
