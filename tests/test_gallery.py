"""The run's gallery: one self-contained HTML page built from records (no engine here), opened
in headless Chromium (the DOM and a screenshot) showing the items, their captions, structured
fields and errors; its size stays bounded for a run of 100,000 items."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from vlm_caption.tasks.results.gallery import STRIP_FRAMES, THUMB_BYTES, build_gallery, gallery_key, sample_items
from vlm_caption.tasks.records import ResultRecord
from tests.images import image_bytes, video_bytes


def record(key: str, *, text: str | None = "a caption", error: dict | None = None, question: str = "What is it?",
           structured=None, metadata=None, video=None) -> ResultRecord:
    return ResultRecord(key=key, size=10, etag="e", sha256="s", recipe="llava", model="m", question=question,
                        prompt=None, text=None if error else text, finish_reason="stop", error=error,
                        structured=structured, metadata=metadata, video=video, timings={}, fingerprint="f",
                        run_id="r")


def test_a_gallery_of_100000_items_is_bounded():
    records = (record(f"img/{i:06d}.jpg", text="words " * 400,
                      error={"kind": "decode", "message": "bad", "retryable": False} if i % 10 == 0 else None)
               for i in range(100_000))
    images = {}

    def fetch(r):  # every image a different real picture, so thumbnails are real JPEGs
        n = int(r.key[4:10])
        return images.setdefault(n % 50, image_bytes("JPEG", size=(1024, 768), color=(n % 250, 90, 40)))

    page, shown = build_gallery(records, fetch, 200, "run", {"run": "r"}, fetch_s=600)
    assert len(shown) == 200
    assert len(page) < 4_000_000, len(page)  # 200 thumbnails of a few KB, texts cut
    assert page.count('class="item failed"') == 50  # errors get a quarter of the places
    assert page.count("data:image/jpeg;base64,") == 200  # each a real thumbnail (a failed one too, if it decodes)
    assert page.count('<details class="caption">') == 150  # long captions: their start, the rest on a click


def test_a_store_that_does_not_answer_costs_the_run_its_time_for_pictures_and_no_more():
    """One picture's read hangs (a stalled store, retried on and on): the page is written once
    the time for pictures is up, that item with a placeholder, the others with thumbnails."""
    import threading
    import time

    records = [record(f"img/{i}.jpg") for i in range(6)]
    release = threading.Event()

    def fetch(r):
        if r.key == "img/3.jpg":
            release.wait(60)
        return image_bytes("JPEG", size=(64, 48))

    started = time.monotonic()
    page, shown = build_gallery(records, fetch, 10, "run", {"run": "r"}, fetch_s=1.5)
    took = time.monotonic() - started
    release.set()
    assert len(shown) == 6 and 1.5 <= took < 10, took
    assert page.count("data:image/jpeg;base64,") == 5
    assert '<div class="item" data-key="img/3.jpg"><div class="placeholder">image</div>' in page


def test_sample_keeps_an_items_questions_together():
    records = [record(f"k{i}", question=q) for i in range(30) for q in ("q1", "q2")]
    items = sample_items(records, 10)
    assert len(items) == 10 and all([r.question for r in item.records] == ["q1", "q2"] for item in items)
    assert gallery_key("abc") == "manifests/abc.html"


def test_the_sample_is_drawn_from_the_runs_own_parts_never_the_history(tmp_path):
    """A run that wrote parts samples them alone; one that wrote none (everything was done)
    lists and reads nothing: its page costs what the run added, not the output's history."""
    from vlm_caption.tasks.results.gallery import run_records
    from vlm_caption.tasks.results.writers import write_shard
    from vlm_caption.tasks.sources.storage import open_storage
    from tests.test_parquet_view import Watched

    out = open_storage(str(tmp_path / "out"), create=True)
    write_shard(out, "f", "old-run", 0, [record("old.jpg")], "src/")
    mine = write_shard(out, "f", "this-run", 0, [record("new.jpg", question="q1"), record("new.jpg", question="q2")],
                       "src/")
    assert [(r.key, r.question) for r in run_records(out, [mine])] == [("new.jpg", "q1"), ("new.jpg", "q2")]
    watched = Watched(out)
    assert list(run_records(watched, [])) == [] and watched.calls == []


def test_a_video_item_shows_a_strip_of_frames_and_a_bad_one_a_placeholder():
    clips = {"good.mp4": video_bytes(frames=40, fps=10, size=(320, 240)), "bad.mp4": b"not a video at all" * 50}

    def fetch(r):
        if r.key == "gone.mp4":
            raise OSError("connection reset")
        return clips[r.key]

    records = [record(key, video={"frames": 16}) for key in ("good.mp4", "bad.mp4", "gone.mp4")]
    page, shown = build_gallery(records, fetch, 10, "run", {"run": "r"}, fetch_s=600)
    assert len(shown) == 3
    strips = re.findall(r'<div class="strip" data-frames="(\d+)">(.*?)</div>', page)
    assert len(strips) == 1 and strips[0][0] == str(STRIP_FRAMES)
    frames = re.findall(r'<img src="(data:image/jpeg;base64,[^"]+)"', strips[0][1])
    assert len(frames) == STRIP_FRAMES and len(set(frames)) == STRIP_FRAMES  # distinct frames, evenly spaced
    assert sum(len(f) for f in frames) * 3 / 4 < THUMB_BYTES * 1.01  # bounded like a thumbnail
    assert page.count('class="placeholder">video<br>16 frames') == 2  # undecodable, unfetchable: no failure


@pytest.mark.parametrize("cores, slots", [(1, 2), (12, 6), (64, 16)])
def test_videos_are_decoded_on_half_the_cores_side_by_side(monkeypatch, cores, slots):
    """The run's end waits for its page: its clips are fetched and decoded several at once, as many
    as half the process's cores (at least 2, at most one per fetcher), never more."""
    import threading
    import time

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    clip = video_bytes(frames=8, fps=8, size=(64, 48))
    lock, running, most = threading.Lock(), [0], [0]

    def fetch(r):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.1)  # long enough for every free slot to be taken meanwhile
        with lock:
            running[0] -= 1
        return clip

    records = [record(f"clip-{i}.mp4", video={"frames": 8}) for i in range(40)]
    page, shown = build_gallery(records, fetch, 40, "run", {"run": "r"}, fetch_s=600)
    assert len(shown) == 40 and page.count('<div class="strip"') == 40
    assert most[0] == slots


def test_where_the_run_decodes_its_clips_in_the_pool_the_gallerys_strips_are_decoded_there(monkeypatch):
    """A GPU host decodes its clips in the decode pool's processes (VLM_CAPTION_VIDEO_DECODE_IN_POOL),
    as one process decodes one clip at a time: the page's strips are decoded there too, several at
    once, not one after another in the run's process while the run waits for its page; and shrunk
    there to the strip's size, so only small frames come back."""
    import base64
    import io

    from PIL import Image

    import vlm_caption.tasks.media.pool as pool
    from vlm_caption.tasks.results.gallery import STRIP_PIXELS
    from vlm_caption.tasks.settings import get_settings

    def not_here(*args, **kwargs):
        raise AssertionError("decoded in the run's process")

    arrived, take = [], pool.taken

    def taken(frames):
        frames = take(frames)
        arrived.append(frames.shape)
        return frames

    monkeypatch.setattr(pool, "decode_video", not_here)  # the pool's processes import their own
    monkeypatch.setattr(pool, "taken", taken)
    monkeypatch.setenv("VLM_CAPTION_VIDEO_DECODE_IN_POOL", "true")
    monkeypatch.setenv("VLM_CAPTION_DECODE_PROCESSES", "2")
    # At the pool's nice 10 beside a loaded machine's own work (stress --cpu 4) a pool process gets a
    # sliver of a core: its import of vLLM's loader took over 10 minutes there. Priority is not what
    # this test is about.
    monkeypatch.setenv("VLM_CAPTION_DECODE_NICENESS", "0")
    get_settings.cache_clear()
    monkeypatch.setattr(pool, "_POOL", None)  # a pool made now is made for videos
    monkeypatch.setattr(pool, "_POOL_SIZE", 0)
    try:
        clips = {f"clip-{i}.mp4": video_bytes(frames=16, fps=8, size=(192, 128), seed=i) for i in range(6)}
        clips["bad.mp4"] = b"not a video at all" * 50
        records = [record(key, video={"frames": 8}) for key in clips]
        # fetch_s: this pool is made here, its two processes spawned and importing on a machine that may
        # be busy (a run's pool already exists); the test is where the strips are decoded, not how fast
        page, shown = build_gallery(records, lambda r: clips[r.key], 10, "run", {"run": "r"}, fetch_s=600)
        assert len(shown) == 7 and page.count('<div class="strip"') == 6
        assert page.count('class="placeholder">video<br>8 frames') == 1  # the broken clip
        assert pool._POOL is not None and len(pool._POOL._processes) == 2
        assert arrived == [(4, 64, STRIP_PIXELS, 3)] * 6  # 4 frames of 192x128, shrunk to 96x64 in the pool
        first = page.split('<div class="strip"', 1)[1].split("base64,", 1)[1].split('"', 1)[0]
        assert Image.open(io.BytesIO(base64.b64decode(first))).size == (STRIP_PIXELS, 64)
    finally:
        if pool._POOL is not None:
            pool._POOL.shutdown()
        get_settings.cache_clear()


def chromium() -> str | None:
    return next((found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))),
                None)


def browse(browser: str, page: Path, profile: Path, screenshot: Path | None = None) -> str:
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={profile}",
            "--window-size=1200,900", "--allow-file-access-from-files"]
    args += [f"--screenshot={screenshot}", page.as_uri()] if screenshot else ["--dump-dom", page.as_uri()]
    done = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_gallery_in_headless_chromium(tmp_path: Path):
    browser = chromium()
    if browser is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("CI=true but chromium is not installed (.ci/run installs it with apt-get)")
        pytest.skip("needs chromium (apt-get install chromium)")
    pictures = {f"shards/00000.tar/{i:06d}": image_bytes("PNG", size=(300, 200), color=(40 * i, 120, 200))
                for i in range(4)}
    records = [record(key, text=f"caption number {i} <b>not bold</b>", metadata={"txt": f"alt {i}"},
                      structured={"tags": ["red", f"t{i}"]} if i == 1 else None)
               for i, key in enumerate(pictures)]
    records.append(record("shards/00001.tar", error={"kind": "bad_input", "retryable": False,
                                                     "message": "shards/00001.tar: cut short at byte 3000"}))
    records.append(record("clip.mp4", text="a dog runs", video={"frames": 8}))  # not fetchable: a placeholder
    pictures["clips/strip.mp4"] = video_bytes(frames=40, fps=10, size=(320, 240))
    records.append(record("clips/strip.mp4", text="bands move", video={"frames": 16}))
    records.append(record("noise.jpg", text="ŋ" * 900))  # a random-weight model's noise: one 900-letter word
    page, shown = build_gallery(records, lambda r: pictures.get(r.key), 50, "vlm-caption · llava · s3://b/shards/",
                                {"run": "r1"})
    assert len(shown) == 8
    path = tmp_path / "r1.html"
    # The page as it is, and a script that says (in the DOM) how many captions run past their card.
    path.write_text(page.replace("</body>", "<script>document.body.dataset.overflowing = [...document."
                                 "querySelectorAll('.caption')].filter(e => e.scrollWidth > e.clientWidth + 1)"
                                 ".length;</script></body>"))

    dom = browse(browser, path, tmp_path / "profile")
    text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<style>.*?</style>", " ", dom, flags=re.S))))
    for i in range(4):
        assert f"caption number {i} <b>not bold</b>" in text  # escaped: shown as text, not markup
        assert f"shards/00000.tar/{i:06d}" in text and f"alt {i}" in text
    assert "error: bad_input: shards/00001.tar: cut short at byte 3000" in text
    assert '"t1"' in text and "a dog runs" in text and "8 frames" in text
    assert dom.count('class="item failed"') == 1 and dom.count("<img") == 4 + STRIP_FRAMES
    strip = re.search(r'data-key="clips/strip.mp4">.*?<div class="strip" data-frames="(\d+)">(.*?)</div>', dom, re.S)
    assert strip and int(strip[1]) == STRIP_FRAMES and strip[2].count("<img") == STRIP_FRAMES
    assert "bands move" in text and "video · 16 frames" in text
    assert dom.index("shards/00001.tar") < dom.index("shards/00000.tar/000000")  # errors first
    assert 'data-overflowing="0"' in dom  # every caption wraps inside its card, the 900-letter word too
    noise = re.search(r'<details class="caption">(.*?)</details>', dom, re.S)[1]
    assert "show all 900 characters" in noise and "ŋ" * 900 in noise  # all of it, on a click

    shot = tmp_path / "gallery.png"
    browse(browser, path, tmp_path / "profile", screenshot=shot)
    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (1200, 900)
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20) or []
    assert len(colors) > 50  # thumbnails drawn, not a blank page
    red = sum(count for count, (r, g, b) in colors if r > 180 and g < 80 and b < 80)
    assert red > 50  # the failed item's red border and message


def test_a_picture_that_cannot_be_fetched_is_counted_on_the_page_and_logged(caplog):
    """A read that fails (the object is gone since, access denied) shows a placeholder; the page's
    header says how many pictures were not fetched, and the run's log names them."""
    records = [record(f"img/{i}.jpg") for i in range(4)]

    def fetch(r):
        if r.key == "img/1.jpg":
            raise PermissionError("access denied")
        return image_bytes("JPEG", size=(64, 48))

    page, shown = build_gallery(records, fetch, 10, "run", {"run": "r"}, fetch_s=600)
    assert len(shown) == 4 and page.count("data:image/jpeg;base64,") == 3
    assert "pictures not fetched: 1" in page
    assert '<div class="item" data-key="img/1.jpg"><div class="placeholder">image</div>' in page


def test_the_uis_gallery_artifact_opens_from_the_ui(prefect_api, s3_client, tmp_path, monkeypatch):
    """A folder output, and an S3 output by default: the page's items as a table (the UI cannot
    open a file:// or s3:// link). An S3 output whose operator set VLM_CAPTION_GALLERY_LINK_S: a
    presigned link that a browser opens, the page served as HTML, its expiry stated."""
    import httpx
    from prefect import flow
    from prefect.artifacts import Artifact

    from vlm_caption.tasks.results.gallery_page import publish_gallery
    from vlm_caption.tasks.sources.storage import open_storage

    items = sample_items([record("a.jpg", text="a long caption " * 60),
                          record("b.jpg", error={"kind": "decode", "message": "not an image", "retryable": False})], 10)
    s3_client.create_bucket(Bucket="gallery")
    outputs = {"folder": open_storage(str(tmp_path / "out"), create=True), "s3": open_storage("s3://gallery/out/")}
    for out in outputs.values():
        out.write("manifests/r1.html", b"<!doctype html><title>the gallery</title>")

    from vlm_caption.tasks.settings import get_settings

    outputs["s3-link"] = outputs["s3"]
    for kind, out in outputs.items():
        if kind == "s3-link":
            monkeypatch.setenv("VLM_CAPTION_GALLERY_LINK_S", "3600")
            get_settings.cache_clear()
        flow(name=f"gallery-{kind}")(lambda: publish_gallery(out, "manifests/r1.html", items))()
        artifact = Artifact.get("vlm-caption-gallery")
        if kind != "s3-link":
            assert artifact.type == "table" and f"{out.describe('manifests/r1.html')}" in artifact.description
            rows = json.loads(artifact.data)
            assert [(r["key"], r["caption"][:20]) for r in rows] == [("b.jpg", "error: decode: not a"),
                                                                     ("a.jpg", "a long caption a lon")]
            assert rows[1]["caption"].endswith("more characters on the page)")  # the page has it all
        else:
            assert artifact.type == "markdown" and "valid until" in artifact.data
            link = re.search(r"\[Open the gallery\]\((https?://[^)]+)\)", artifact.data)[1]
            page = httpx.get(link, timeout=30)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "<title>the gallery</title>" in page.text
    get_settings.cache_clear()
