"""Video and multi-image through the whole flow: a bucket (moto S3 over HTTP), the Prefect API,
real vLLM on CPU with tiny random checkpoints. Several questions per item, the chat method,
job manifests with s3://, http:// and relative media, and resume at (item, question) grain.

Engines are cached per process, so tests that share a recipe, model and image limit share one.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.params import CaptionJob
from tests.checkpoints import build_checkpoint
from tests.images import VIDEO_CORPUS_ERRORS, corrupt_jpeg, image_bytes, video_bytes, video_corpus
from tests.result_files import s3_records

BUCKET = "media-kinds"


@pytest.fixture(scope="module")
def bucket(s3_endpoint):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket=BUCKET)
    return client


def put(s3_client, objects: dict[str, bytes]) -> None:
    for key, body in objects.items():
        s3_client.put_object(Bucket=BUCKET, Key=key, Body=body)


def records(s3_client, out: str) -> list[dict]:
    return s3_records(s3_client, BUCKET, out)


def run(**fields) -> dict:
    state = vlm_caption(CaptionJob(**fields), return_state=True)
    assert state.is_completed(), state.message
    return state.result()


# ---- video ---------------------------------------------------------------------------------
def test_videos_from_a_bucket_get_captions_and_broken_ones_error_records(prefect_api, bucket, checkpoints_root):
    model = build_checkpoint("qwen2_vl", checkpoints_root)
    put(bucket, {f"clips/clip{i}.mp4": video_bytes(frames=16 + 8 * i, fps=8, seed=i) for i in range(3)})
    put(bucket, {"clips/corrupt.mp4": video_bytes()[:300], "clips/empty.mp4": b""})
    odd = video_corpus()  # no frames, sound only, two hours (captioned), four hours (over the limit), text
    put(bucket, {f"clips/{name}": data for name, data in odd.items()})

    summary = run(source=f"s3://{BUCKET}/clips/", output=f"s3://{BUCKET}/video-out/", recipe="qwen2_vl",
                  modality="video", num_frames=4, model=str(model), shard_size=2, sampling={"max_tokens": 6})
    found = {r["key"]: r for r in records(bucket, "video-out/")}
    assert sorted(found) == sorted(["clip0.mp4", "clip1.mp4", "clip2.mp4", "corrupt.mp4", "empty.mp4", *odd])
    for i in range(3):
        clip = found[f"clip{i}.mp4"]
        assert clip["error"] is None and clip["output_tokens"] > 0, clip["error"]
        assert clip["video"]["frames"] == 4 and clip["video"]["fps"] == 8.0
        assert clip["video"]["duration_s"] == pytest.approx((16 + 8 * i) / 8, abs=0.2)
        assert (clip["video"]["width"], clip["video"]["height"]) == (64, 48)
        assert "<|video_pad|>" in clip["prompt"] and clip["prompt_tokens"] > 20  # frames were expanded
        assert clip["question"].startswith("Describe what happens in this video")
    assert found["corrupt.mp4"]["error"]["kind"] == "decode"
    assert found["empty.mp4"]["error"]["kind"] == "decode" and "empty" in found["empty.mp4"]["error"]["message"]
    for name, kind in VIDEO_CORPUS_ERRORS.items():
        assert found[name]["error"]["kind"] == kind and found[name]["error"]["message"], found[name]
    long_clip = found["two-hours.mp4"]
    assert long_clip["error"] is None and long_clip["video"]["duration_s"] == 7200.0, long_clip["error"]
    assert summary["succeeded"] == 4 and summary["failed"] == 2 + len(VIDEO_CORPUS_ERRORS)


def test_video_metadata_reaches_the_request_for_recipes_that_need_it():
    """Qwen3-VL and GLM-4.xV get (frames, metadata) as the example passes them; others frames."""
    from vlm_caption.tasks.engine.steps import GenerateOptions, engine_request
    from vlm_caption.recipes import get_recipe
    from vlm_caption.tasks.engine.arguments import EngineSpec
    from vlm_caption.tasks.engine.vllm_engine import Sampling
    from vlm_caption.tasks.prepare import PreparedItem
    from vlm_caption.tasks.media.video import VideoLimits, decode_video
    from vlm_caption.tasks.sources.items import ObjectRef, WorkItem

    video = decode_video(video_bytes(), num_frames=4, limits=VideoLimits(60, 10**6))
    item = PreparedItem(WorkItem("v.mp4", (ObjectRef("v.mp4", 1, "e"),)), ("q",), sha256="abc", media=video)
    for recipe in ("qwen3_vl", "glm4_1v"):
        spec = EngineSpec.build(get_recipe(recipe), modality="video")
        request = engine_request(item, "q", GenerateOptions(spec, Sampling(), num_frames=4))
        frames, metadata = request.media
        assert frames.shape == (4, 48, 64, 3)
        assert metadata["total_num_frames"] == 24 and metadata["fps"] == 8.0 and len(metadata["frames_indices"]) == 4
        assert request.uuids == "abc-f4"  # another frame count is another processor input
    plain = engine_request(item, "q", GenerateOptions(EngineSpec.build(get_recipe("qwen2_vl"), modality="video"), Sampling()))
    assert plain.media.shape == (4, 48, 64, 3)


def test_video_guards_give_readable_errors():
    from vlm_caption.tasks.media.image import MediaError
    from vlm_caption.tasks.media.video import VideoLimits, decode_video

    clip = video_bytes(frames=80, fps=8)  # 10 s, 64x48
    with pytest.raises(MediaError, match="over the limit of 5 s"):
        decode_video(clip, num_frames=4, limits=VideoLimits(5, 10**6))
    with pytest.raises(MediaError, match="64x48, over the limit of 1000 pixels"):
        decode_video(clip, num_frames=4, limits=VideoLimits(60, 1000))
    with pytest.raises(MediaError, match="not a video"):
        decode_video(image_bytes(), num_frames=4, limits=VideoLimits(60, 10**6))


# ---- multi-image -------------------------------------------------------------------------------
ALBUMS = {
    "albums/beach/1.jpg": image_bytes(size=(80, 60), color=(20, 120, 220)),
    "albums/beach/2.png": image_bytes("PNG", size=(60, 80), color=(230, 200, 90)),
    "albums/city/a.jpg": image_bytes(size=(70, 70), color=(90, 90, 90)),
    "albums/city/b.jpg": image_bytes(size=(64, 48), color=(200, 30, 30)),
    "albums/big/1.jpg": image_bytes(color=(1, 2, 3)),
    "albums/big/2.jpg": image_bytes(color=(4, 5, 6)),
    "albums/big/3.jpg": image_bytes(color=(7, 8, 9)),  # three images, over max_images=2
    "albums/broken/1.jpg": image_bytes(),
    "albums/broken/2.jpg": corrupt_jpeg(),
}


@pytest.fixture(scope="module")
def idefics3(checkpoints_root):
    return str(build_checkpoint("idefics3", checkpoints_root))


@pytest.fixture(scope="module")
def albums(bucket):
    put(bucket, ALBUMS)
    return f"s3://{BUCKET}/albums/"


def group_job(model: str, out: str, **extra) -> dict:
    return {"source": f"s3://{BUCKET}/albums/", "output": f"s3://{BUCKET}/{out}/", "recipe": "idefics3",
            "modality": "multi-image", "max_images": 2, "model": model, "shard_size": 3,
            "sampling": {"max_tokens": 5}, **extra}


@pytest.mark.parametrize("method", ["generate", "chat"])
def test_folder_groups_with_generate_and_chat(prefect_api, bucket, albums, idefics3, method):
    summary = run(**group_job(idefics3, f"groups-{method}", method=method))
    found = {r["key"]: r for r in records(bucket, f"groups-{method}/")}
    assert sorted(found) == ["beach", "big", "broken", "city"]
    for name in ("beach", "city"):
        group = found[name]
        assert group["error"] is None and group["output_tokens"] > 0, group["error"]
        assert [m["key"] for m in group["members"]] == sorted(k.removeprefix("albums/") for k in ALBUMS
                                                             if k.startswith(f"albums/{name}/"))
        assert all(len(m["sha256"]) == 64 for m in group["members"])
        assert group["prompt"].count("<image>") >= 2  # both images reached the prompt
    assert found["big"]["error"]["kind"] == "too_many_images" and "limit of 2" in found["big"]["error"]["message"]
    assert [m["key"] for m in found["big"]["members"]] == ["big/1.jpg", "big/2.jpg", "big/3.jpg"]
    assert found["broken"]["error"]["kind"] == "decode"
    assert summary["succeeded"] == 2 and summary["failed"] == 2


def test_two_questions_one_fetch_and_decode_each_then_resume_by_question(prefect_api, bucket, albums, idefics3,
                                                                         monkeypatch):
    import vlm_caption.tasks.media.pool as pool
    from vlm_caption.tasks.settings import get_settings
    from vlm_caption.tasks.sources.reader import SourceReader

    monkeypatch.setenv("VLM_CAPTION_DECODE_PROCESSES", "0")  # decode in this process, to count it
    get_settings.cache_clear()
    fetched, decoded = Counter(), Counter()
    real_read, real_decode = SourceReader.read_member, pool.decode_job
    monkeypatch.setattr(SourceReader, "read_member",
                        lambda self, ref: fetched.update([ref.key]) or real_read(self, ref))
    monkeypatch.setattr(pool, "decode_job", lambda data, *a: decoded.update([len(data)]) or real_decode(data, *a))

    # The run's gallery fetches a thumbnail's source once more after the run (bounded by
    # gallery_items, tests/test_gallery.py); here only the captioning path's fetches are counted.
    job = group_job(idefics3, "questions", glob="*.jpg", questions=["What is shown?", "Which colours?"],
                    gallery_items=0)
    first = run(**job)
    found = records(bucket, "questions/")
    good = [r for r in found if r["error"] is None]
    assert Counter(r["key"] for r in good) == {"beach": 2, "city": 2}  # beach has one .jpg: a group of one
    assert Counter((r["key"], r["question"]) for r in found) == Counter(
        {(g, q): 1 for g in ("beach", "big", "broken", "city") for q in job["questions"]})
    # each image fetched and decoded once, whatever the number of questions (big is never fetched)
    assert all(count == 1 for count in fetched.values()) and "big/1.jpg" not in fetched
    assert sum(decoded.values()) == sum(fetched.values())
    assert first["processed"] == 8

    fetched.clear()
    again = run(**job)
    assert again["processed"] == 0 and again["skipped_already_done"] == 4 and not fetched

    third = run(**{**job, "questions": [*job["questions"], "How many people?"]})
    assert third["processed"] == 4  # only the new question, for each of the four groups
    added = [r for r in records(bucket, "questions/") if r["question"] == "How many people?"]
    assert sorted(r["key"] for r in added) == ["beach", "big", "broken", "city"]
    assert len(records(bucket, "questions/")) == 12
    get_settings.cache_clear()


@pytest.fixture(scope="module")
def http_media(tmp_path_factory):
    """A loopback HTTP server for a manifest's https?:// media (the example fetches URLs)."""
    root = tmp_path_factory.mktemp("http-media")
    (root / "remote.png").write_bytes(image_bytes("PNG", size=(72, 54), color=(10, 200, 60)))
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_a_manifest_of_groups_with_per_item_questions_and_gemma3_chat(prefect_api, bucket, albums, http_media,
                                                                      checkpoints_root, tmp_path):
    model = str(build_checkpoint("gemma3", checkpoints_root))
    put(bucket, {"index/local/x.jpg": image_bytes(size=(50, 70), color=(150, 40, 200))})
    lines = [
        {"id": "mixed", "media": [f"s3://{BUCKET}/albums/beach/1.jpg", f"{http_media}/remote.png", "local/x.jpg"],
         "questions": ["Compare them.", "What differs?"]},
        {"id": "pair", "media": ["local/x.jpg", f"s3://{BUCKET}/albums/city/a.jpg"], "question": "Same place?"},
        {"id": "missing", "media": [f"{http_media}/nope.png"], "question": "Anything?"},
    ]
    bucket.put_object(Bucket=BUCKET, Key="index/jobs.jsonl", Body="\n".join(json.dumps(x) for x in lines).encode())
    for method in ("generate", "chat"):
        summary = run(manifest=f"s3://{BUCKET}/index/jobs.jsonl", output=f"s3://{BUCKET}/manifest-{method}/",
                      recipe="gemma3", modality="multi-image", method=method, model=model, max_images=3,
                      sampling={"max_tokens": 4})
        found = {(r["key"], r["question"]): r for r in records(bucket, f"manifest-{method}/")}
        assert sorted(found) == [("mixed", "Compare them."), ("mixed", "What differs?"), ("pair", "Same place?")]
        for key in (("mixed", "Compare them."), ("mixed", "What differs?"), ("pair", "Same place?")):
            assert found[key]["error"] is None and found[key]["output_tokens"] > 0, found[key]["error"]
            assert found[key]["prompt_tokens"] > len(found[key]["prompt"]) // 8  # the images were expanded
        assert [m["key"] for m in found[("mixed", "What differs?")]["members"]] == lines[0]["media"]
        # The retryable error is the manifest's (its failures), not a record kept in the output's files.
        written = f"manifest-{method}/manifests/{summary['run_id']}.json"
        manifest = json.loads(bucket.get_object(Bucket=BUCKET, Key=written)["Body"].read())
        (missing,) = [f for f in manifest["failures"] if (f["key"], f["question"]) == ("missing", "Anything?")]
        assert missing["kind"] == "fetch" and missing["retryable"] is True  # a rerun tries it again


def test_a_bad_manifest_line_stops_the_job_before_any_engine(prefect_api, tmp_path):
    from vlm_caption.tasks.sources.storage import StorageError

    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text('{"id": "a", "media": ["x.jpg"]}\n{"id": "b", "media": []}\n')
    with pytest.raises(StorageError, match="line 2: media"):
        vlm_caption(CaptionJob(manifest=str(manifest), output=str(tmp_path / "out"), recipe="idefics3",
                               modality="multi-image", skip_model_check=True))
    assert not (tmp_path / "out" / "parquet").exists()
