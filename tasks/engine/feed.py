"""A continuous feed for one long-lived vLLM engine: vLLM's `AsyncLLM`, fed from any thread
(docs/architecture.md). `LLM.generate` per shard drains the running batch at every shard's end
(0.85x raw vLLM on an H100 at the default shard size). Here an event loop of the feed's own runs
one coroutine per request and vLLM's output handler; a shard's thread submits its requests and
waits on their futures. A request vLLM rejects fails alone; when the engine dies, every waiter
fails with `EngineDied`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from vlm_caption.tasks.engine import vllm_api
from vlm_caption.tasks.errors import EngineFailure
from vlm_caption.tasks.settings import get_settings

# How long closing the feed waits for vLLM's engine process to stop before vLLM kills it (vLLM's
# own default, 5 s, was too short for the CPU build on a busy 2-core machine).
ENGINE_STOP_S = 20.0

# Requests in the engine at once, at most: twice the engine's batch, so that when a wave of
# requests finishes together the next wave is already waiting (H100, tiny LLaVA, 10,240 images
# at 640x480, shard size 64: 512 in flight against a batch of 1024 gave 118 img/s, 0.72x raw
# vLLM; shard size 512, 3,072 in flight, 162 img/s).
FEED_REQUESTS = 2048
# The least any image feed aims at.
FEED_ITEMS = 512


def shards_holding(requests: int, shard_size: int, questions: int) -> int:
    """How many shards it takes to hold `requests` requests (one per item and question)."""
    return -(-requests // max(1, shard_size * questions))


def feed_depth(modality: str, shard_size: int, questions: int, sizing: dict | None,
               shard_media_bytes: float | None = None, shared: bool = False,
               request_tokens: float | None = None) -> int:
    """Shards whose requests are in the engine at once (`VLM_CAPTION_FEED_DEPTH` wins), sized in
    requests and bytes: on an H100 (7B, 1920x1080) 6 shards of 64 kept the batch full (1.06x raw
    vLLM), 6 shards of 16 starved it (0.92x). Images: at least 6 shards and twice the engine's
    `max_num_seqs`, between FEED_ITEMS and FEED_REQUESTS, as far as `shard_media_bytes` (a
    prepared shard's, on average) fits `feed_media_bytes`, never fewer than 2 shards; groups of
    images the same (at 2 shards the engine drained at each shard's end: 0.87x of 6 on an H200);
    videos: 2. `sizing`: the engine's (None before it is up).

    `shared` (claims, tasks/claims.py): a shard in the feed is one the other partitions cannot
    take, so the feed aims at twice what the engine runs at once (KV cache over `request_tokens`,
    docs/operations.md); before a request has finished, twice its batch, at most FEED_ITEMS; before
    it is up, 6 shards. A deeper feed let the first of two H100s claim 34 of 48 shards while its
    engine started, and the second GPU idled for half the run."""
    settings = get_settings()
    if settings.feed_depth:
        return max(1, settings.feed_depth)
    if modality == "video":
        return 2
    seqs = (sizing or {}).get("max_num_seqs") or 0
    if shared:
        kv_tokens = (sizing or {}).get("kv_cache_tokens") or 0
        running = min(seqs, int(kv_tokens // request_tokens)) if request_tokens and kv_tokens else 0
        if running:
            requests = max(min(FEED_ITEMS, running), min(FEED_REQUESTS, 2 * running))
        else:  # up with nothing finished yet: its batch bounds it; not up: the floor below
            requests = min(FEED_ITEMS, 2 * seqs)
    else:  # (before the engine is up, the floor below: flows/feed_schedule.py prepares no more then)
        requests = max(min(FEED_ITEMS, seqs), min(FEED_REQUESTS, 2 * seqs))
    depth = max(6, shards_holding(requests, shard_size, questions))
    if shard_media_bytes:
        depth = min(depth, int(settings.feed_media_bytes // shard_media_bytes))
    return max(2, depth)


class EngineDied(EngineFailure, RuntimeError):
    """The engine stopped answering while requests were in it (e.g. its process was killed)."""


class EngineFeed:
    """Requests into one `AsyncLLM` from any thread. `build` makes the engine on the feed's loop
    (its client's sockets and queues belong to the loop that uses them)."""

    def __init__(self, build: Callable[[], Any]):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-feed", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        self._closed = False

        async def make():
            return build()

        try:
            self.llm = asyncio.run_coroutine_threadsafe(make(), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise

    def submit(self, prompt: dict[str, Any], params, lora=None, tokenization: dict | None = None) -> Future:
        """A future that resolves to the request's vLLM `RequestOutput` (or raises its error)."""
        if self._closed:
            failed: Future = Future()
            failed.set_exception(EngineDied("the engine was released"))
            return failed
        return asyncio.run_coroutine_threadsafe(self._generate(prompt, params, lora, tokenization), self._loop)

    async def _generate(self, prompt, params, lora, tokenization):
        final = None
        try:
            async for output in self.llm.generate(prompt, params, f"vc-{next(self._ids)}", lora_request=lora,
                                                  tokenization_kwargs=tokenization):
                final = output
        except asyncio.CancelledError:
            raise EngineDied("the engine was released") from None
        except Exception as exc:  # noqa: BLE001 - sorted: the engine's death, or this request's own error
            if vllm_api.is_dead_engine_error(exc) or self.llm.errored:
                raise EngineDied(f"the vLLM engine process died: {type(exc).__name__}: {exc}") from None
            # AsyncLLM wraps an unexpected error of one request (bad media, say) in its own type.
            cause = exc.__cause__ if type(exc).__name__ == "EngineGenerateError" and exc.__cause__ else exc
            raise cause from None
        return final

    def close(self) -> None:
        """Stop feeding and shut vLLM's engine process down; requests still in the engine fail
        with `EngineDied`."""
        if self._closed:
            return
        self._closed = True

        async def stop():
            waiting = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in waiting:
                task.cancel()
            if waiting:
                await asyncio.wait(waiting, timeout=ENGINE_STOP_S)
            # vLLM's own clean-up: left to the interpreter's exit, multiprocessing terminates the
            # engine process first, and vLLM logs "engine core exited unexpectedly" after every run.
            with contextlib.suppress(Exception):  # already dead: nothing left to stop
                self.llm.shutdown(timeout=ENGINE_STOP_S)

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(ENGINE_STOP_S * 2 + 10)
        except Exception as exc:  # noqa: BLE001 - the run is ending either way; the process exit ends vLLM's
            from vlm_caption.tasks.observability import get_logger

            get_logger().warning("the engine did not stop cleanly; its process ends with this one",
                                 error=f"{type(exc).__name__}: {exc}")
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
