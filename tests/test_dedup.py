"""Each distinct media captioned once across runs and across the partitions of a fanned-out run
(issue 53; the copies within one run's process are tests/test_run_cost.py's): a copy of a done
result takes its answer with no engine request (found by the done-index's content column, or
before any fetch by listed ETags that are MD5s), and a fanned-out run's planner puts copies in
copy shards that the partitions take once the originals are done."""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vlm_caption.tasks.engine.vllm_engine import CaptionEngine
from vlm_caption.tasks.results.done_index import load_done_index
from vlm_caption.tasks.records import ResultRecord, sha256_hex
from vlm_caption.tasks.results.writers import write_shard
from vlm_caption.tasks.sources.items import ObjectRef, Shard, WorkItem
from vlm_caption.tasks.sources.storage import LocalStorage, open_storage
from tests.images import image_bytes
from tests.processes import idle_partition_deployment as create_idle_partition_deployment
from tests.result_files import records as _records, s3_records

FP = "d" * 16
def _write(out, fingerprint: str, parts_id: str, shard: int, records: list) -> str | None:
    """A shard's part, as a run of the job with source `src/` writes it."""
    return write_shard(out, fingerprint, parts_id, shard, records, "src/")
IDLE_POOL = "no-workers-for-dedup"


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def _record(key: str, data: bytes, question: str = "q", text: str = "a caption", etag: str | None = None,
            error=None, duplicate_of: str | None = None) -> ResultRecord:
    return ResultRecord(key=key, size=len(data), etag=etag if etag is not None else _md5(data), sha256=sha256_hex(data),
                        recipe="llava", model="m", question=question, prompt=None, text=text, finish_reason="stop",
                        output_tokens=7, error=error, duplicate_of=duplicate_of, timings={}, fingerprint=FP,
                        run_id="r1")


def _pictures(count: int) -> dict[str, bytes]:
    return {f"photo{i}.jpg": image_bytes("JPEG", size=(64 + i, 48), color=(i * 40, 100, 220 - i * 40))
            for i in range(count)}


@pytest.fixture
def engine_requests(monkeypatch) -> list[str]:
    """The media ids of every request the engine is asked (all partitions of this process)."""
    real_run, asked = CaptionEngine.run, []

    def run(self, requests, sampling, method="generate"):
        asked.extend(r.uuids for r in requests)
        return real_run(self, requests, sampling, method)

    monkeypatch.setattr(CaptionEngine, "run", run)
    return asked


# ---- the done-index finds a done result by its bytes and reads its answer back --------------------

def test_a_done_result_is_found_by_content_and_by_md5_etags_and_its_part_read_once(tmp_path, prefect_api):
    out = open_storage(str(tmp_path / "out"), create=True)
    cat, dog = b"cat bytes", b"dog bytes"
    failed = {"kind": "decode", "message": "broken", "retryable": False}
    _write(out, FP, "r1", 0, [_record("copy.jpg", cat, text="copied", duplicate_of="cat.jpg"),
                                      _record("cat.jpg", cat, text="a cat"), _record("cat.jpg", cat, "other", "no"),
                                      _record("dog.jpg", dog, text=None, error=failed)])
    _write(out, FP, "r1", 1, [_record("old.jpg", b"old", etag="size-mtime")])
    done = load_done_index.fn(out, FP)

    found = done.earlier_answer("q", sha256=sha256_hex(cat))
    assert found.key == "cat.jpg" and found.text == "a cat"  # the item captioned, before a copy of it
    assert done.earlier_answer("other", sha256=sha256_hex(cat)).text == "no"
    assert done.earlier_answer("new question", sha256=sha256_hex(cat)) is None
    assert done.earlier_answer("q", sha256=sha256_hex(dog)) is None  # a failure is no answer to copy
    by_etag = done.earlier_answer("q", signature=((_md5(cat), len(cat)),))
    assert by_etag.key == "cat.jpg"
    assert done.earlier_answer("q", signature=((_md5(cat), len(cat) + 1),)) is None
    assert done.reads == 1  # one read of the part for every lookup
    assert done.earlier_answer("q", sha256=sha256_hex(b"old")).key == "old.jpg"

    # A group is a copy when all its members are, in order.
    from vlm_caption.tasks.records import Member

    members = [Member(key=f"g/{i}.jpg", size=len(b), etag=_md5(b), sha256=sha256_hex(b)) for i, b in enumerate((cat, dog))]
    group = _record("g", cat + dog, text="two pets").model_copy(update={"members": members, "etag": ""})
    _write(out, FP, "r1", 2, [group])
    done = load_done_index.fn(out, FP)
    both = tuple((_md5(b), len(b)) for b in (cat, dog))
    assert done.earlier_answer("q", signature=both).key == "g"
    assert done.earlier_answer("q", signature=both[::-1]) is None and done.earlier_answer("q", signature=both[:1]).key != "g"

    # Rows without a content hash (written before records had one) take part in no lookup by content.
    _write(out, "e" * 16, "r0", 0, [_record("cat.jpg", cat).model_copy(update={"sha256": None})])
    assert load_done_index.fn(out, "e" * 16).earlier_answer("q", sha256=sha256_hex(cat)) is None


def test_a_copy_whose_listed_etag_is_an_md5_is_answered_without_being_fetched(tmp_path, prefect_api):
    """Its members' listed ETags equal a done result's and are MD5s: the copy is not downloaded
    (its file is not even there) and takes the answer; a multipart-style ETag (with '-') is
    fetched, as is any item whose ETags are not content hashes."""
    from vlm_caption.tasks import prepare

    out = open_storage(str(tmp_path / "out"), create=True)
    cat = image_bytes("PNG", size=(40, 30))
    _write(out, FP, "r1", 0, [_record("cat.png", cat, text="a cat")])
    done = load_done_index.fn(out, FP)
    source_dir = tmp_path / "src"
    source_dir.mkdir()
    from vlm_caption.tasks.sources.formats import SourceSpec

    shard = Shard(0, (WorkItem("gone-copy.png", (ObjectRef("gone-copy.png", len(cat), _md5(cat)),)),
                      WorkItem("multipart.png", (ObjectRef("multipart.png", len(cat), _md5(cat)[:30] + "-2"),))))
    prepare_shard = getattr(prepare.prepare_shard, "fn", prepare.prepare_shard)
    prepared = prepare_shard(SourceSpec(str(source_dir)), shard, done, ("q",), prepare.MediaOptions())
    copy, fetched = prepared.items
    assert copy.error is None and copy.copies["q"].key == "cat.png" and copy.media is None
    assert copy.sha256 == sha256_hex(cat) and copy.members[0].sha256 == sha256_hex(cat)
    assert fetched.copies == {} and fetched.error is not None and fetched.error.kind == "fetch"  # it was asked for


# ---- the planner of a fanned-out run ----------------------------------------------------------------

def test_the_planner_finds_copies_by_md5_etags_and_in_a_folder_hashes_only_equal_sizes(tmp_path):
    from vlm_caption.tasks.same_media import ListedCopies

    etags = ListedCopies()
    item = lambda key, size, etag: WorkItem(key, (ObjectRef(key, size, etag),))  # noqa: E731
    md5 = "0123456789abcdef0123456789abcdef"
    assert not etags.is_copy(item("a.jpg", 5, md5)) and etags.is_copy(item("b.jpg", 5, md5))
    assert not etags.is_copy(item("c.jpg", 6, md5))  # another size: other bytes
    assert not etags.is_copy(item("d.jpg", 5, "abc-2")) and not etags.is_copy(item("e.jpg", 5, "abc-2"))

    folder = LocalStorage(tmp_path, create=True)
    for name, data in {"a.jpg": b"12345", "b.jpg": b"xyz", "c.jpg": b"12345", "d.jpg": b"54321"}.items():
        (tmp_path / name).write_bytes(data)
    reads = []
    real_read = folder.read
    folder.read = lambda key: reads.append(key) or real_read(key)
    local = ListedCopies(folder)
    listed = [ref for ref in folder.iter_objects()]
    assert [local.is_copy(WorkItem(ref.key, (ref,))) for ref in listed] == [False, False, True, False]
    assert sorted(reads) == ["a.jpg", "c.jpg", "d.jpg"]  # b.jpg's size is its own: never read


def test_copies_go_to_copy_shards_that_only_the_copies_pass_reads(tmp_path, monkeypatch):
    import threading

    import vlm_caption.tasks.sources.listing as listing
    from vlm_caption.tasks.claims import ShardClaims
    from vlm_caption.tasks.shard_plan import SharedListing
    from vlm_caption.tasks.sources.formats import SourceSpec

    class OnAThread:
        @staticmethod
        def submit(stream):
            threading.Thread(target=stream.produce, daemon=True).start()

    monkeypatch.setattr(listing, "list_source", OnAThread)
    source = tmp_path / "src"
    source.mkdir()
    for name, data in {"a.jpg": b"A" * 10, "b.jpg": b"B" * 11, "c.jpg": b"A" * 10, "d.jpg": b"D" * 12,
                       "e.jpg": b"B" * 11}.items():
        (source / name).write_bytes(data)
    out = LocalStorage(tmp_path / "out", create=True)
    everything = lambda items: [True] * len(items)  # noqa: E731
    with ShardClaims(out, "run1", 0) as claims:
        plan = SharedListing(out, "run1", claims, SourceSpec(str(source)), 2, None, everything).start()
        originals = [[item.id for item in shard.items] for shard in plan]
        assert originals == [["a.jpg", "b.jpg"], ["d.jpg"]] and plan.copy_shards == {1}
        copies = SharedListing(out, "run1", claims, SourceSpec(str(source)), 2, None, everything,
                               shards="copies").start()
        assert [[item.id for item in shard.items] for shard in copies] == [["c.jpg", "e.jpg"]]
        assert not plan.originals_done()
        for index in (0, 2):
            claims.mark_done(index)
        assert plan.originals_done()


# ---- through the flow: a rerun, and two partitions ----------------------------------------------------

def test_a_rerun_answers_new_keys_that_are_copies_of_earlier_results_without_the_engine(
        prefect_api, tiny_llava, tmp_path, engine_requests):
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob

    media, out = tmp_path / "media", tmp_path / "out"
    media.mkdir()
    originals = _pictures(5)
    for name, data in originals.items():
        (media / name).write_bytes(data)
    job = CaptionJob(source=str(media), output=str(out), model=str(tiny_llava), shard_size=3,
                     sampling={"max_tokens": 6})
    assert vlm_caption(job, return_state=True).is_completed()
    assert len(engine_requests) == 5
    first = {r["key"]: r for r in _records(out)}

    copies = {"copy-of-0.jpg": "photo0.jpg", "again-0.jpg": "photo0.jpg", "zz-copy-of-3.jpg": "photo3.jpg"}
    for name, original in copies.items():
        (media / name).write_bytes(originals[original])
    engine_requests.clear()
    state = vlm_caption(job, return_state=True)
    assert state.is_completed(), state.message
    assert engine_requests == []  # every new key is a copy of an earlier run's result
    found = {r["key"]: r for r in _records(out)}
    assert len(found) == 8
    for name, original in copies.items():
        record = found[name]
        assert record["duplicate_of"] == original and record["text"] == first[original]["text"]
        assert record["sha256"] == first[original]["sha256"] and record["output_tokens"] == 0
        assert record["run_id"] != first[original]["run_id"] and record["error"] is None
    manifest = json.loads(Path(state.result()["manifest"]).read_text())
    assert manifest["counts"]["duplicates"] == 3 and manifest["counts"]["skipped_already_done"] == 5
    assert manifest["counts"]["processed"] == 3 and manifest["cost"]["copies"] == 3
    gallery = (out / "manifests" / f"{manifest['run_id']}.html").read_text()
    assert "copy of photo0.jpg" in gallery and "copies: 3" in gallery


@pytest.fixture(scope="module")
def idle_partition_deployment(prefect_api) -> str:
    return create_idle_partition_deployment("partition-dedup", IDLE_POOL)


def test_copies_in_two_partitions_are_captioned_once(idle_partition_deployment, tiny_llava, tmp_path,
                                                      monkeypatch, engine_requests):
    """Two partitions run at once (the child on a thread of the parent's process, sharing its
    engine but not its in-process answers); each takes every other shard of the plan, so a copy
    and its original land in different partitions: 5 requests for 8 images, 3 copies."""
    import vlm_caption.flows.caption as caption
    from vlm_caption.flows.params import CaptionJob
    from vlm_caption.flows.plan import PartitionRun
    from vlm_caption.tasks.claims import ShardClaims

    real_claim, real_caption = ShardClaims.claim, caption.caption_shards
    monkeypatch.setattr(ShardClaims, "claim", lambda self, shard, compare=False: (
        shard.index % 2 == self.partition and real_claim(self, shard, compare=compare)))
    child = {}

    def both_partitions(run: PartitionRun):
        if run.partition.index == 0:  # the child's partition starts beside the parent's
            other = dataclasses.replace(run, partition=run.partition.model_copy(update={"index": 1}))
            child[1] = ThreadPoolExecutor(1).submit(contextvars.copy_context().run, real_caption, other)
            return real_caption(run)
        return child.pop(1).result()  # the parent takes the child over: its partition ran already

    monkeypatch.setattr(caption, "caption_shards", both_partitions)
    media, out = tmp_path / "media", tmp_path / "out"
    media.mkdir()
    originals = _pictures(5)
    copies = {"copy-of-0.jpg": "photo0.jpg", "again-0.jpg": "photo0.jpg", "zz-copy-of-3.jpg": "photo3.jpg"}
    for name, data in {**originals, **{name: originals[o] for name, o in copies.items()}}.items():
        (media / name).write_bytes(data)
    job = CaptionJob(source=str(media), output=str(out), model=str(tiny_llava), shard_size=1, fan_out=2,
                     partition_deployment=idle_partition_deployment, sampling={"max_tokens": 6})
    state = caption.vlm_caption(job, return_state=True)
    assert state.is_completed(), state.message

    assert sorted(engine_requests) == sorted(sha256_hex(data) for data in originals.values())  # 5 requests
    found = {r["key"]: r for r in _records(out)}
    assert len(found) == 8 and all(r["error"] is None for r in found.values())
    duplicates = {key: r for key, r in found.items() if r["duplicate_of"]}
    assert len(duplicates) == 3
    partition = lambda record: record["run_id"].rsplit("-", 1)[1]  # noqa: E731
    for record in duplicates.values():
        first = found[record["duplicate_of"]]
        assert first["duplicate_of"] is None and first["sha256"] == record["sha256"] and record["text"] == first["text"]
    assert any(partition(r) != partition(found[r["duplicate_of"]]) for r in duplicates.values())
    assert {partition(r) for r in found.values()} == {"p0", "p1"}
    manifest = json.loads((out / "manifests" / f"{state.result()['run_id']}.json").read_text())
    assert manifest["counts"]["duplicates"] == 3 and manifest["counts"]["processed"] == 8
    assert sum(p["duplicates"] for p in manifest["partitions"]) == 3


def test_on_s3_a_rerun_does_not_even_download_copies_whose_etag_is_their_md5(prefect_api, s3_client, tiny_llava,
                                                                           engine_requests):
    """S3's ETag of a single-part upload is the object's MD5: the new keys' (ETag, size) equal
    the earlier results', so they are answered from the listing, with no GET of their bytes."""
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob
    from vlm_caption.tasks.sources.s3_client import shared_s3_client

    s3_client.create_bucket(Bucket="dedup")
    originals = _pictures(4)
    for name, data in originals.items():
        s3_client.put_object(Bucket="dedup", Key=f"images/{name}", Body=data)
    job = CaptionJob(source="s3://dedup/images/", output="s3://dedup/captions/", model=str(tiny_llava),
                     shard_size=2, gallery_items=0, sampling={"max_tokens": 6})
    assert vlm_caption(job, return_state=True).is_completed()
    assert len(engine_requests) == 4

    copies = {"copy-of-1.jpg": "photo1.jpg", "zz-copy-of-2.jpg": "photo2.jpg"}
    for name, original in copies.items():
        s3_client.put_object(Bucket="dedup", Key=f"images/{name}", Body=originals[original])
    fetched: list[str] = []
    shared_s3_client().meta.events.register(
        "provide-client-params.s3.GetObject", lambda params, **_: fetched.append(params["Key"]), unique_id="dedup-test")
    engine_requests.clear()
    try:
        state = vlm_caption(job, return_state=True)
    finally:
        shared_s3_client().meta.events.unregister("provide-client-params.s3.GetObject", unique_id="dedup-test")
    assert state.is_completed(), state.message
    assert any(key.startswith("captions/") for key in fetched)  # the count sees the run's reads (its done-index)
    assert engine_requests == [] and not [key for key in fetched if key.startswith("images/")]
    records = {r["key"]: r for r in s3_records(s3_client, "dedup", "captions/")}
    for name, original in copies.items():
        assert records[name]["duplicate_of"] == original and records[name]["text"] == records[original]["text"]
        assert records[name]["sha256"] == sha256_hex(originals[original])
