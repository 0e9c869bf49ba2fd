"""A continuous feed for one long-lived vLLM engine.

`LLM.generate` per shard adds a shard's requests, runs them to the last one and returns, so
the running batch drains to zero at the end of every shard (measured: 0.85x raw vLLM on an
H100 at the default shard size). Here one thread owns the engine: it adds requests as shards
hand them in (`LLMEngine.add_request`, one request at a time so a request vLLM rejects fails
alone) and steps the engine (`LLMEngine.step`) while any is unfinished, resolving each
request's future as it finishes. Several shards' requests are in the engine at once; the shard
stays the unit of bookkeeping, never a batch boundary.

Each request is rendered first (tokens, and the HF processor over its media): by a
`RenderPool` when there is one and it is ready, otherwise by the feed thread itself.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from tasks.engine import vllm_api
from tasks.engine.render import RenderJob, render
from tasks.errors import EngineFailure
from tasks.settings import get_settings

# How long closing the feed waits for vLLM's engine process to stop before vLLM kills it (vLLM's
# own default, 5 s, was too short for the CPU build on a busy 2-core machine).
ENGINE_STOP_S = 20.0

# Requests in the engine at once, at most: twice the engine's batch, so that when a wave of
# requests finishes together the next wave is already waiting (H100, tiny LLaVA, 10,240 images
# at 640x480, shard size 64: 512 in flight against a batch of 1024 gave 118 img/s, 0.72x raw
# vLLM; shard size 512, 3,072 in flight, 162 img/s).
FEED_REQUESTS = 2048
# The least any image feed aims at, and before the engine is up, until a prepared shard tells
# how many bytes a shard's decoded images hold.
FEED_ITEMS = 512


def shards_holding(requests: int, shard_size: int, questions: int) -> int:
    """How many shards it takes to hold `requests` requests (one per item and question)."""
    return -(-requests // max(1, shard_size * questions))


def feed_depth(modality: str, shard_size: int, questions: int, sizing: dict | None,
               shard_media_bytes: float | None = None, shared: bool = False,
               request_tokens: float | None = None) -> int:
    """Shards whose requests are in the engine at once (`VLM_CAPTION_FEED_DEPTH` wins). Counted
    in shards but sized in requests and bytes: on an H100 (7B, 1920x1080) 6 shards of 64 kept
    the batch full (1.06x raw vLLM) while 6 shards of 16 starved it (0.92x). So images get at
    least 6 shards and twice the engine's batch (`max_num_seqs`) of requests, between FEED_ITEMS
    and FEED_REQUESTS (one per item and question), as far as their decoded media fit in
    `feed_media_bytes` (`shard_media_bytes`: a prepared shard's, on average; never fewer than
    2 shards, or the engine would drain between them); videos and groups get 2 shards, their
    frames being large. `sizing`: the engine's (None before it is up).

    `shared`: the run's shards are shared with other partitions by claims (tasks/claims.py), and
    every shard in the feed is one the others cannot take. Such a feed aims at twice what the
    engine runs at once, from its KV cache and `request_tokens` (a finished request's prompt and
    output tokens on average): a 7B model on an H100 runs about 175 photos at once, not its
    `max_num_seqs` of 1024. Once the engine is up and until a request has finished, twice its
    batch, at most FEED_ITEMS; before it is up, the floor of 6 shards: a claim made while the
    engine starts is one a partition that is already generating cannot take. On two H100s with
    3,072 photos the deep feed let the first partition claim 34 of the 48 shards while its
    engine started, and the second GPU idled for half the run; on CPU with shards of one item,
    FEED_ITEMS let the first partition claim all 40 before the second had listed the source."""
    settings = get_settings()
    if settings.feed_depth:
        return max(1, settings.feed_depth)
    if modality != "image":
        return 2
    seqs = (sizing or {}).get("max_num_seqs") or 0
    if shared:
        kv_tokens = (sizing or {}).get("kv_cache_tokens") or 0
        running = min(seqs, int(kv_tokens // request_tokens)) if request_tokens and kv_tokens else 0
        if running:
            requests = max(min(FEED_ITEMS, running), min(FEED_REQUESTS, 2 * running))
        else:  # up with nothing finished yet: its batch bounds it; not up: the floor below
            requests = min(FEED_ITEMS, 2 * seqs)
    elif sizing:
        requests = max(min(FEED_ITEMS, seqs), min(FEED_REQUESTS, 2 * seqs))
    else:  # before the engine is up: the most it could take, once a shard's bytes bound it
        requests = FEED_REQUESTS if shard_media_bytes else FEED_ITEMS
    depth = max(6, shards_holding(requests, shard_size, questions))
    if shard_media_bytes:
        depth = min(depth, int(settings.feed_media_bytes // shard_media_bytes))
    return max(2, depth)


@dataclass
class _Submission:
    job: RenderJob
    params: Any
    lora: Any
    future: Future
    rendered: Any = None  # the EngineInput, when the render pool made it


class EngineDied(EngineFailure, RuntimeError):
    """The engine stopped answering while requests were in it (e.g. its process was killed)."""


class EngineFeed:
    def __init__(self, llm, render_pool=None):
        self._llm = llm
        self._render_pool = render_pool
        self._inbox: queue.Queue[_Submission | None] = queue.Queue()
        self._pending: dict[str, Future] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._dead_lock = threading.Lock()  # a rendered request is never queued after the drain
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vllm-feed", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch, name="vllm-feed-watchdog", daemon=True).start()

    def submit(self, job: RenderJob, params, lora=None, *, pooled: bool = True) -> Future:
        """A future that resolves to the request's vLLM `RequestOutput` (or raises its error).
        `pooled=False` keeps the rendering in this process (large media not worth a copy)."""
        submission = _Submission(job, params, lora, Future())
        pool = self._render_pool
        rendering = None
        if pooled and pool is not None and pool.ready:
            try:
                rendering = pool.submit(job)
            except RuntimeError:  # the pool is closed or broken: render here
                rendering = None
        if rendering is None:
            self._queue(submission)
        else:
            rendering.add_done_callback(lambda done: self._rendered(submission, done))
        return submission.future

    def _rendered(self, submission: _Submission, rendering: Future) -> None:
        error = EngineDied("the render pool was closed") if rendering.cancelled() else rendering.exception()
        if isinstance(error, (BrokenProcessPool, EngineDied)):  # not this request's fault: retry the shard
            submission.future.set_exception(EngineDied(f"rendering stopped: {error}"))
        elif error is not None:
            submission.future.set_exception(error)
        else:
            submission.rendered = rendering.result()
            self._queue(submission)

    def _queue(self, submission: _Submission) -> None:
        with self._dead_lock:
            if self._dead is None:
                self._inbox.put(submission)
                return
        submission.future.set_exception(EngineDied(f"the engine is gone: {self._dead}"))

    def close(self) -> None:
        """Stop feeding and shut vLLM's engine process down, from the feed thread (the only one
        that touches the engine); requests still in the engine fail with `EngineDied`."""
        self._closed.set()
        self._inbox.put(None)
        self._thread.join(ENGINE_STOP_S + 10)

    def _watch(self) -> None:
        """Wake the feed if the engine process dies under it.

        vLLM 0.26's client notices a dead engine process but never wakes a `step()` already
        waiting for outputs: it would wait forever. This hands that wait an error to raise
        (tasks/engine/vllm_api.py), so the waiting shards fail and are retried on a new engine."""
        watch = vllm_api.engine_process_watch(self._llm)
        if watch is None:
            return
        died, wake = watch
        while not self._closed.wait(1.0):
            if died():
                wake(EngineDied("the vLLM engine process died"))
                return

    # ---- the feed thread, the only one that touches the engine -------------------------------
    def _loop(self) -> None:
        try:
            while True:
                # Block for new work only when the engine has nothing to do.
                block = not self._pending
                while True:
                    try:
                        item = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    if item is None:
                        self._fail_all(EngineDied("the engine was released"))
                        return
                    self._add(item)
                    block = False
                if self._pending:
                    self._step()
        except BaseException as exc:  # noqa: BLE001 - every waiting shard must hear of it
            self._fail_all(exc)
        finally:
            self._stop_engine()

    def _stop_engine(self) -> None:
        """Shut the engine process down the way vLLM does. Left to the interpreter's exit,
        multiprocessing terminates it before vLLM's own clean-up runs, and vLLM then logs
        "engine core exited unexpectedly" (or "force killing") after every clean run."""
        with contextlib.suppress(Exception):  # already dead: nothing left to stop
            vllm_api.shutdown_engine(self._llm, ENGINE_STOP_S)

    def _add(self, item: _Submission) -> None:
        request_id = f"vc-{next(self._ids)}"  # outputs carry this id (vLLM suffixes its own copy)
        try:
            rendered = item.rendered if item.rendered is not None else render(self._llm.renderer, item.job)
            self._llm.llm_engine.add_request(request_id, rendered, item.params, lora_request=item.lora)
        except Exception as exc:  # noqa: BLE001 - this request's own error (too long, bad media)
            if vllm_api.is_dead_engine_error(exc):  # not this request's: fail all, retry shards
                item.future.set_exception(EngineDied(str(exc)))
                raise
            item.future.set_exception(exc)
            return
        self._pending[request_id] = item.future

    def _step(self) -> None:
        for output in self._llm.llm_engine.step():
            if output.finished:
                future = self._pending.pop(output.request_id, None)
                if future is not None:
                    future.set_result(output)

    def _fail_all(self, exc: BaseException) -> None:
        with self._dead_lock:
            self._dead = exc
        error = EngineDied(f"the engine failed with requests in flight: {type(exc).__name__}: {exc}")
        for future in self._pending.values():
            future.set_exception(error)
        self._pending.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item.future.set_exception(error)
