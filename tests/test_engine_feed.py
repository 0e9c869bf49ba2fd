"""The continuous engine feed's bookkeeping, against a stand-in for vLLM's LLM that finishes
requests out of order, a few per step, and rejects some while rendering (as vLLM rejects a
prompt that is too long): every request resolves exactly once, rejections stay with their
request, and a dead engine fails everything in flight instead of hanging it. The same holds
when a render pool renders the requests, and a render worker that dies fails its requests as
an engine failure (the shard is retried), never as the items' own errors."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from concurrent.futures.process import BrokenProcessPool

from tasks.engine.feed import ENGINE_STOP_S, EngineDied, EngineFeed
from tasks.engine.render import RenderJob, render

# `render` imports vLLM's prompt parsing on its first call, in the feed's thread: 15-30 s on a
# busy 2-core machine, which the first test's 30 s wait for a result would otherwise include.
import vllm.renderers.inputs.preprocess  # noqa: F401


class StandInRenderer:
    """vLLM's renderer as `render()` calls it: rejects a prompt that is too long."""

    model_config = SimpleNamespace(is_encoder_decoder=False)
    default_cmpl_tok_params = None

    def __init__(self):
        self.threads: set[str] = set()

    def render_cmpl(self, prompts, tok_params):
        self.threads.add(threading.current_thread().name)
        (prompt,) = prompts
        if prompt["prompt"].startswith("bad"):
            raise ValueError(f"prompt {prompt['prompt']!r} is longer than the model's context")
        return [{"type": "token", **prompt}]


class StandInLLM:
    def __init__(self, die_after_steps: int | None = None, first_step_waits_for=None):
        # `first_step_waits_for`: a condition the first forward pass waits on (10 s at most), so
        # that a test sees other shards' requests arrive while one is in the engine however
        # slowly the machine schedules its threads.
        self.first_step_waits_for = first_step_waits_for
        self.pending: list[str] = []
        self.steps = 0
        self.max_in_engine = 0
        self.die_after_steps = die_after_steps
        self.rng = random.Random(7)
        self.owner: set[str] = set()
        self.renderer = StandInRenderer()
        self.added: list[str] = []
        self.llm_engine = SimpleNamespace(step=self._step, add_request=self._add_request)

    def _add_request(self, request_id, rendered, params, lora_request=None):
        self.owner.add(threading.current_thread().name)
        assert rendered["type"] == "token"  # only rendered requests reach the engine
        self.added.append(rendered["prompt"])
        self.pending.append(request_id)  # outputs carry the caller's id ...
        self.max_in_engine = max(self.max_in_engine, len(self.pending))
        return f"{request_id}-{self.rng.getrandbits(32):08x}"  # ... vLLM returns it suffixed

    def _step(self):
        self.owner.add(threading.current_thread().name)
        self.steps += 1
        time.sleep(0.002)  # a forward pass takes time; shards hand in requests meanwhile
        if self.steps == 1 and self.first_step_waits_for:
            deadline = time.monotonic() + 10
            while not self.first_step_waits_for() and time.monotonic() < deadline:
                time.sleep(0.001)
        if self.die_after_steps is not None and self.steps > self.die_after_steps:
            raise RuntimeError("EngineCore died")
        self.rng.shuffle(self.pending)
        done, self.pending = self.pending[:3], self.pending[3:]
        return [SimpleNamespace(request_id=r, finished=True) for r in done] + \
               [SimpleNamespace(request_id=r, finished=False) for r in self.pending[:1]]


class StandInRenderPool:
    """`RenderPool`'s interface over threads named render-*; `broken` fails every rendering as
    a pool whose worker process died does."""

    def __init__(self, renderer, broken: bool = False):
        self.ready, self.renderer, self.broken = True, renderer, broken
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="render")

    def submit(self, job):
        if self.broken:
            future = Future()
            future.set_exception(BrokenProcessPool("A process in the process pool was terminated abruptly"))
            return future
        return self._threads.submit(render, self.renderer, job)


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("shard_size", [1, 7, 64])
def test_every_request_resolves_once_across_concurrent_shards(shard_size, pooled):
    # The first forward pass lasts until three requests are in the engine or waiting in the
    # feed's queue (with shards of 1: one from each of the three shards running at once).
    llm = StandInLLM(first_step_waits_for=lambda: len(llm.pending) + feed._inbox.qsize() >= 3)
    pool_renderer = StandInRenderer()
    feed = EngineFeed(llm, StandInRenderPool(pool_renderer) if pooled else None)
    prompts = [f"{'bad' if i % 11 == 5 else 'ok'}-{i}" for i in range(150)]
    shards = [prompts[i:i + shard_size] for i in range(0, len(prompts), shard_size)]

    def run_shard(shard):
        futures = [feed.submit(RenderJob(prompt={"prompt": p}), params=None) for p in shard]
        results = []
        for prompt, future in zip(shard, futures):
            try:
                results.append((prompt, future.result(timeout=30).request_id))
            except ValueError as exc:
                results.append((prompt, f"error: {exc}"))
        return results

    with ThreadPoolExecutor(max_workers=3) as pool:  # shards overlap, as the flow runs them
        results = [r for shard in pool.map(run_shard, shards) for r in shard]
    feed.close()
    assert [p for p, _ in results] == prompts  # every request answered, in its shard's order
    ids = [r for _, r in results if not r.startswith("error")]
    assert len(ids) == len(set(ids)) == sum(1 for p in prompts if p.startswith("ok"))  # none twice
    assert all("longer than the model's context" in r for p, r in results if p.startswith("bad"))
    assert llm.owner == {"vllm-feed"}  # only the feed thread touches the engine
    assert sorted(llm.added) == sorted(p for p in prompts if p.startswith("ok"))
    if pooled:  # every request rendered by the pool, none by the feed thread
        assert not llm.renderer.threads and all(t.startswith("render") for t in pool_renderer.threads)
    else:
        assert llm.renderer.threads == {"vllm-feed"}
    if shard_size == 1:
        assert llm.max_in_engine > 1  # requests of several shards were in the engine together


def test_a_dead_engine_fails_every_waiting_request_and_later_ones():
    feed = EngineFeed(StandInLLM(die_after_steps=2))
    futures = [feed.submit(RenderJob(prompt={"prompt": f"ok-{i}"}), params=None) for i in range(20)]
    outcomes = []
    for future in futures:
        try:
            future.result(timeout=30)
            outcomes.append("done")
        except EngineDied as exc:
            outcomes.append("died")
            assert "EngineCore died" in str(exc)
    assert "died" in outcomes  # nothing hangs
    with pytest.raises(EngineDied):
        feed.submit(RenderJob(prompt={"prompt": "ok-late"}), params=None).result(timeout=5)


def test_closing_the_feed_fails_what_is_in_flight_and_shuts_the_engine_down_from_its_thread():
    """Releasing an engine (exit, another model) stops vLLM's engine process cleanly, from the
    thread that owns the engine; requests still in it fail as an engine failure, none hangs."""
    closing = threading.Event()
    llm = StandInLLM(first_step_waits_for=closing.is_set)  # requests are in the engine at close
    shutdowns = []
    llm.llm_engine.engine_core = SimpleNamespace(
        shutdown=lambda timeout: shutdowns.append((threading.current_thread().name, timeout)))
    feed = EngineFeed(llm)
    futures = [feed.submit(RenderJob(prompt={"prompt": f"ok-{i}"}), params=None) for i in range(6)]
    deadline = time.monotonic() + 30
    while llm.steps == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    closing.set()
    feed.close()
    assert shutdowns == [("vllm-feed", ENGINE_STOP_S)]
    finished, released = 0, 0
    for future in futures:  # every one resolved by the time close() returned
        try:
            future.result(timeout=0)
            finished += 1
        except EngineDied as exc:
            assert "released" in str(exc)
            released += 1
    # One step ran (it finishes three at most); the rest were in flight or queued at close.
    assert finished + released == 6 and released >= 3
    with pytest.raises(EngineDied):
        feed.submit(RenderJob(prompt={"prompt": "ok-late"}), params=None).result(timeout=5)


def test_a_render_worker_that_dies_fails_its_requests_as_an_engine_failure():
    llm = StandInLLM()
    feed = EngineFeed(llm, StandInRenderPool(llm.renderer, broken=True))
    futures = [feed.submit(RenderJob(prompt={"prompt": f"ok-{i}"}), params=None) for i in range(5)]
    for future in futures:  # EngineDied makes the shard retry on a new engine and pool ...
        with pytest.raises(EngineDied, match="terminated abruptly"):
            future.result(timeout=10)
    assert llm.added == []  # ... and no item is recorded as failed by its own fault
    # Video frames stay in the engine's process (pooled=False): rendered by the feed itself.
    assert feed.submit(RenderJob(prompt={"prompt": "ok-video"}), params=None, pooled=False).result(timeout=10)
    feed.close()


def test_the_feed_depth_keeps_twice_the_engines_batch_of_images_in_flight(monkeypatch):
    """Shards in the engine at once, sized in requests: twice the engine's batch (H100, tiny
    LLaVA: 512 in flight against a batch of 1024 ran at 0.72x raw vLLM), so small shards get
    more of them, never fewer than 6 -- unless their decoded media would pass
    `feed_media_bytes`, and then never fewer than 2; videos and groups 2; the setting wins."""
    from tasks.engine.feed import FEED_ITEMS, FEED_REQUESTS, feed_depth
    from tasks.settings import get_settings

    monkeypatch.delenv("VLM_CAPTION_FEED_DEPTH", raising=False)
    monkeypatch.setenv("VLM_CAPTION_FEED_MEDIA_BYTES", str(2 * 1024**3))
    get_settings.cache_clear()
    engine, mid, small = {"max_num_seqs": 1024}, {"max_num_seqs": 256}, {"max_num_seqs": 8}  # start_engine's "sizing"
    assert feed_depth("image", 16, 1, engine) == FEED_REQUESTS // 16 == 128
    assert feed_depth("image", 64, 1, engine) == 32
    assert feed_depth("image", 16, 2, engine) == 64  # two questions: two requests per item
    assert feed_depth("image", 64, 1, mid) == 2 * 256 // 64 == 8
    assert feed_depth("image", 1024, 1, engine) == feed_depth("image", 16, 1, small) == 6
    # Before the engine is up: FEED_ITEMS until a prepared shard tells its bytes, then the most
    # the feed could hold, so that the shards are decoded while the engine starts.
    crops, photos = 64 * 336 * 336 * 3, 64 * 1920 * 1080 * 3
    assert feed_depth("image", 16, 1, None) == FEED_ITEMS // 16 == 32
    assert feed_depth("image", 64, 1, None, crops) == FEED_REQUESTS // 64 == 32
    assert feed_depth("image", 64, 1, None, photos) == 5
    # Decoded media bound it: 64 crops of 336x336 fit 32 times over; 64 photos of 1920x1080 not.
    assert feed_depth("image", 64, 1, engine, crops) == 32
    assert feed_depth("image", 64, 1, engine, photos) == 2 * 1024**3 // photos == 5
    assert feed_depth("image", 1024, 1, engine, 16 * photos) == 2  # never so few that the engine drains
    assert feed_depth("video", 16, 1, engine) == feed_depth("multi-image", 16, 1, engine) == 2
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
