"""The continuous engine feed's bookkeeping, against a stand-in for vLLM's `AsyncLLM` that
finishes requests out of order and rejects some (as vLLM rejects a prompt that is too long, or
wraps a request's own error in `EngineGenerateError`): every request resolves exactly once, from
shards submitting on threads of their own, with several shards' requests in the engine at once;
rejections stay with their request; a dead engine fails everything in flight and everything
later instead of hanging it; releasing the engine fails what is in flight and shuts it down."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from vlm_caption.tasks.engine.feed import ENGINE_STOP_S, EngineDied, EngineFeed


class EngineGenerateError(Exception):
    """vLLM's wrapper of one request's unexpected error (matched by name)."""


class StandInAsyncLLM:
    """`AsyncLLM.generate` as the feed calls it. `die_after`: finished requests before the engine
    dies (every waiter then raises, and `errored` turns true, as vLLM's output handler does).
    `hold`: a condition every request waits on before it finishes (10 s at most)."""

    def __init__(self, die_after: int | None = None, hold=None):
        self.errored, self.die_after, self.hold = False, die_after, hold
        self.in_engine = self.max_in_engine = self.finished = 0
        self.threads: set[str] = set()
        self.shutdowns: list[tuple[str, float]] = []
        self.rng = random.Random(7)

    async def generate(self, prompt, params, request_id, lora_request=None, tokenization_kwargs=None):
        self.threads.add(threading.current_thread().name)
        text = prompt["prompt"]
        if text.startswith("bad"):
            raise ValueError(f"prompt {text!r} is longer than the model's context")
        if text.startswith("odd"):
            raise EngineGenerateError() from OSError(f"cannot read the media of {text!r}")
        self.in_engine += 1
        self.max_in_engine = max(self.max_in_engine, self.in_engine)
        try:
            deadline = time.monotonic() + 10
            while self.hold and not self.hold() and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            await asyncio.sleep(self.rng.random() / 100)  # a forward pass; requests finish out of order
            if self.errored or (self.die_after is not None and self.finished >= self.die_after):
                self.errored = True
                raise RuntimeError("EngineCore died")
            self.finished += 1
            yield SimpleNamespace(request_id=request_id, prompt=text, finished=True)
        finally:
            self.in_engine -= 1

    def shutdown(self, timeout=None):
        self.shutdowns.append((threading.current_thread().name, timeout))


def _submit(feed: EngineFeed, text: str):
    return feed.submit({"prompt": text}, params=None)


@pytest.mark.parametrize("shard_size", [1, 7, 64])
def test_every_request_resolves_once_across_concurrent_shards(shard_size):
    feed = EngineFeed(StandInAsyncLLM)
    texts = [f"{'bad' if i % 11 == 5 else 'odd' if i % 13 == 6 else 'ok'}-{i}" for i in range(200)]
    shards = [texts[i:i + shard_size] for i in range(0, len(texts), shard_size)]

    def run_shard(shard):
        futures = [_submit(feed, text) for text in shard]
        results = []
        for text, future in zip(shard, futures):
            try:
                results.append((text, future.result(timeout=60).prompt))
            except (ValueError, OSError) as exc:
                results.append((text, f"{type(exc).__name__}: {exc}"))
        return results

    with ThreadPoolExecutor(max_workers=8) as shard_threads:
        results = [r for shard in shard_threads.map(run_shard, shards) for r in shard]
    feed.close()
    assert [text for text, _ in results] == texts  # each request resolved once, in its shard
    for text, outcome in results:
        if text.startswith("bad"):
            assert outcome.startswith("ValueError") and "longer than the model's context" in outcome
        elif text.startswith("odd"):  # the request's own error, not vLLM's wrapper
            assert outcome == f"OSError: cannot read the media of {text!r}"
        else:
            assert outcome == text
    assert feed.llm.threads == {"vllm-feed"}  # one thread talks to the engine
    assert feed.llm.max_in_engine > shard_size  # requests of several shards were in the engine together


def test_the_engine_is_built_on_the_feeds_own_thread():
    built_on = []
    feed = EngineFeed(lambda: built_on.append(threading.current_thread().name) or StandInAsyncLLM())
    assert built_on == ["vllm-feed"]
    feed.close()
    with pytest.raises(ZeroDivisionError):  # a build that fails is the caller's error, its loop ended
        EngineFeed(lambda: 1 / 0)


def test_a_dead_engine_fails_every_waiting_request_and_later_ones():
    feed = EngineFeed(lambda: StandInAsyncLLM(die_after=5))
    outcomes = []
    for future in [_submit(feed, f"ok-{i}") for i in range(20)]:
        try:
            future.result(timeout=30)
            outcomes.append("done")
        except EngineDied as exc:
            outcomes.append("died")
            assert "EngineCore died" in str(exc)
    assert outcomes.count("done") == 5 and outcomes.count("died") == 15  # nothing hangs
    with pytest.raises(EngineDied):
        _submit(feed, "ok-late").result(timeout=5)
    feed.close()


def test_closing_the_feed_fails_what_is_in_flight_and_shuts_the_engine_down():
    """Releasing an engine (exit, another model) stops vLLM's engine process cleanly; requests
    still in it fail as an engine failure, none hangs, and later ones fail at once."""
    closing = threading.Event()
    feed = EngineFeed(lambda: StandInAsyncLLM(hold=closing.is_set))
    futures = [_submit(feed, f"ok-{i}") for i in range(6)]
    deadline = time.monotonic() + 30
    while feed.llm.in_engine < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    feed.close()
    assert feed.llm.shutdowns == [("vllm-feed", ENGINE_STOP_S)]
    for future in futures:  # every one resolved by the time close() returned
        with pytest.raises(EngineDied, match="released"):
            future.result(timeout=0)
    with pytest.raises(EngineDied, match="released"):
        _submit(feed, "ok-late").result(timeout=5)


def test_the_feed_depth_keeps_twice_the_engines_batch_of_images_in_flight(monkeypatch):
    """Shards in the engine at once, sized in requests: twice the engine's batch (H100, tiny
    LLaVA: 512 in flight against a batch of 1024 ran at 0.72x raw vLLM), so small shards get
    more of them, never fewer than 6 -- unless their decoded media would pass
    `feed_media_bytes`, and then never fewer than 2; groups of images alike; videos 2; the setting wins."""
    from vlm_caption.tasks.engine.feed import FEED_ITEMS, FEED_REQUESTS, feed_depth
    from vlm_caption.tasks.settings import get_settings

    monkeypatch.delenv("VLM_CAPTION_FEED_DEPTH", raising=False)
    monkeypatch.setenv("VLM_CAPTION_FEED_MEDIA_BYTES", str(2 * 1024**3))
    get_settings.cache_clear()
    engine, mid, small = {"max_num_seqs": 1024}, {"max_num_seqs": 256}, {"max_num_seqs": 8}  # start_engine's "sizing"
    assert feed_depth("image", 16, 1, engine) == FEED_REQUESTS // 16 == 128
    assert feed_depth("image", 64, 1, engine) == 32
    assert feed_depth("image", 16, 2, engine) == 64  # two questions: two requests per item
    assert feed_depth("image", 64, 1, mid) == 2 * 256 // 64 == 8
    assert feed_depth("image", 1024, 1, engine) == feed_depth("image", 16, 1, small) == 6
    # Before the engine is up, the floor (the feed prepares only its lookahead then).
    crops, photos = 64 * 336 * 336 * 3, 64 * 1920 * 1080 * 3
    assert feed_depth("image", 16, 1, None) == feed_depth("image", 64, 1, None, crops) == 6
    # Decoded media bound it: 64 crops of 336x336 fit 32 times over; 64 photos of 1920x1080 not.
    assert feed_depth("image", 64, 1, engine, crops) == 32
    assert feed_depth("image", 64, 1, engine, photos) == 2 * 1024**3 // photos == 5
    assert feed_depth("image", 1024, 1, engine, 16 * photos) == 2  # never so few that the engine drains
    assert feed_depth("video", 16, 1, engine) == 2
    assert feed_depth("multi-image", 64, 1, engine) == feed_depth("image", 64, 1, engine) == 32
    assert feed_depth("multi-image", 64, 1, engine, 16 * photos) == 2  # large groups: as far as their bytes fit
    # Shards shared with other partitions: twice what the engine runs at once, from its KV cache
    # and a finished request's tokens; before a request has finished, twice its batch, at most
    # FEED_ITEMS; before the engine is up, 6 shards (what it claims then, the others cannot take).
    h100_7b = {"max_num_seqs": 1024, "kv_cache_tokens": 116_000}
    assert feed_depth("image", 64, 1, None, crops, shared=True) == 6
    assert feed_depth("image", 1, 1, None, shared=True) == 6  # not FEED_ITEMS shards of one item
    assert feed_depth("image", 64, 1, h100_7b, crops, shared=True) == FEED_ITEMS // 64 == 8  # none finished yet
    assert feed_depth("image", 1, 1, {"max_num_seqs": 1}, shared=True) == 6  # one at a time: the floor
    assert feed_depth("image", 64, 1, h100_7b, crops, shared=True, request_tokens=640) == 6  # 181 at once
    assert feed_depth("image", 16, 1, h100_7b, crops, shared=True, request_tokens=640) == 2 * 181 // 16 + 1 == 23
    tiny = {"max_num_seqs": 1024, "kv_cache_tokens": 4_000_000}  # the batch, not the cache, bounds it
    assert feed_depth("image", 64, 1, tiny, crops, shared=True, request_tokens=640) == feed_depth(
        "image", 64, 1, tiny, crops) == 32
    monkeypatch.setenv("VLM_CAPTION_FEED_DEPTH", "3")
    get_settings.cache_clear()
    assert feed_depth("image", 16, 1, engine, photos) == 3
    get_settings.cache_clear()
    assert feed_depth("image", 16, 1, engine) == 3
    get_settings.cache_clear()
