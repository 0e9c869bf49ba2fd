import pytest
from pydantic import ValidationError

from flows.params import CaptionJob
from tasks.records import ObjectRef, ResultRecord, job_fingerprint
from tasks.steps import DoneEntry, is_done, iter_shards


def refs(n):
    return [ObjectRef(f"{i}.jpg", i, f"e{i}") for i in range(n)]


def test_shards_cover_every_object_once_and_respect_limit():
    shards = list(iter_shards(iter(refs(10)), 4))
    assert [len(s.objects) for s in shards] == [4, 4, 2]
    assert [s.index for s in shards] == [0, 1, 2]
    assert sum(len(s.objects) for s in iter_shards(iter(refs(10)), 4, limit=5)) == 5


def test_listing_is_consumed_lazily():
    consumed = []

    def gen():
        for ref in refs(100):
            consumed.append(ref)
            yield ref

    first = next(iter_shards(gen(), 3))
    assert len(first.objects) == 3 and len(consumed) == 3


def test_fingerprint_changes_with_source_prompt_sampling_model_recipe():
    base = dict(source="s3://b/images/", recipe="llava", model="m", question="q", sampling={"temperature": 0.0})
    fp = job_fingerprint(**base)
    assert fp == job_fingerprint(**base)
    assert job_fingerprint(**{**base, "source": "s3://b/images"}) == fp  # a trailing slash is the same place
    for change in ({"source": "s3://b/more/"}, {"question": "other"}, {"model": "n"}, {"recipe": "x"}, {"sampling": {"temperature": 0.5}}):
        assert job_fingerprint(**{**base, **change}) != fp


def test_done_means_same_key_etag_and_size():
    done = {"a.jpg": DoneEntry("e1", 10, "sha")}
    assert is_done(ObjectRef("a.jpg", 10, "e1"), done)
    assert not is_done(ObjectRef("a.jpg", 11, "e1"), done)
    assert not is_done(ObjectRef("a.jpg", 10, "e2"), done)
    assert not is_done(ObjectRef("b.jpg", 10, "e1"), done)


def test_retryable_errors_are_not_final():
    record = dict(key="k", size=1, etag="e", sha256=None, recipe="llava", model="m", prompt=None,
                  text=None, finish_reason=None, timings={}, fingerprint="f", run_id="r")
    assert ResultRecord(**record).is_final
    assert ResultRecord(**record, error={"kind": "decode", "message": "x", "retryable": False}).is_final
    assert not ResultRecord(**record, error={"kind": "fetch", "message": "x", "retryable": True}).is_final


def test_job_defaults_and_validation():
    job = CaptionJob(source="s3://b/in/", output="/tmp/out")
    assert job.recipe == "llava" and job.question.startswith("Describe") and job.shard_size == 64
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
    from flows.caption import vlm_caption

    assert isinstance(vlm_caption, Flow)
    schema = vlm_caption.parameters.model_dump()
    assert schema["required"] == ["job"]
    job_schema = schema["definitions"]["CaptionJob"]
    assert {"source", "output", "recipe", "question", "sampling", "shard_size"} <= set(job_schema["properties"])


def test_partitions_split_a_listing_into_disjoint_slices_that_cover_it():
    from tasks.steps import in_partition

    listing = refs(200)
    slices = [[r.key for r in in_partition(iter(listing), None, (i, 3))] for i in range(3)]
    assert sorted(sum(slices, [])) == sorted(r.key for r in listing)  # every key, exactly once
    assert all(30 < len(s) < 110 for s in slices)  # hashed, so roughly balanced
    # The job's limit applies to the listing before partitioning: the slices of 50 cover those 50.
    limited = sum(([r.key for r in in_partition(iter(listing), 50, (i, 3))] for i in range(3)), [])
    assert sorted(limited) == sorted(r.key for r in listing[:50])


def test_a_partition_run_cannot_fan_out_again():
    from flows.params import Partition

    with pytest.raises(ValidationError, match="cannot fan out again"):
        CaptionJob(source="/tmp", output="/tmp/o", fan_out=2, partition=Partition(index=1, count=2, run_id="r"))
    with pytest.raises(ValidationError, match="out of range"):
        Partition(index=2, count=2, run_id="r")


def test_parent_absorbs_child_partition_reports():
    from tasks.report import PartitionReport, RunStats

    stats = RunStats(listed=5, processed=5, succeeded=4, parts=["a"], failures_by_kind={"decode": 1})
    stats.absorb(PartitionReport(index=1, listed=7, processed=6, succeeded=6, skipped=1, parts=["b"],
                                 failures_by_kind={"decode": 2}, failures=[{"key": "x"}, {"key": "y"}]))
    assert (stats.listed, stats.processed, stats.succeeded, stats.skipped) == (12, 11, 10, 1)
    assert stats.failed == 3 and stats.parts == ["a", "b"] and len(stats.failures) == 2
