"""A continuous feed for one long-lived vLLM engine.

`LLM.generate` per shard adds a shard's requests, runs them to the last one and returns, so
the running batch drains to zero at the end of every shard (measured: 0.85x raw vLLM on an
H100 at the default shard size). Here one thread owns the engine: it adds requests as shards
hand them in (`LLM.enqueue`, one request at a time so a request vLLM rejects fails alone) and
steps the engine (`LLMEngine.step`) while any is unfinished, resolving each request's future
as it finishes. Several shards' requests are in the engine at once; the shard stays the unit
of bookkeeping, never a batch boundary.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


@dataclass
class _Submission:
    prompt: dict[str, Any]
    params: Any
    lora: Any
    future: Future


class EngineDied(RuntimeError):
    """The engine stopped answering while requests were in it (e.g. its process was killed)."""


class EngineFeed:
    def __init__(self, llm):
        self._llm = llm
        self._inbox: queue.Queue[_Submission | None] = queue.Queue()
        self._pending: dict[str, Future] = {}
        self._dead: BaseException | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vllm-feed", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch, name="vllm-feed-watchdog", daemon=True).start()

    def submit(self, prompt: dict[str, Any], params, lora=None) -> Future:
        """A future that resolves to the request's vLLM `RequestOutput` (or raises its error)."""
        future: Future = Future()
        if self._dead is not None:
            future.set_exception(EngineDied(f"the engine is gone: {self._dead}"))
        else:
            self._inbox.put(_Submission(prompt, params, lora, future))
        return future

    def close(self) -> None:
        self._closed.set()
        self._inbox.put(None)

    def _watch(self) -> None:
        """Wake the feed if the engine process dies under it.

        vLLM 0.26's client notices a dead engine process (its monitor thread marks it dead and
        shuts the client down) but a `step()` already waiting for outputs is never woken: it
        would wait forever. This puts an error where that wait reads, so the waiting shards
        fail and are retried on a new engine."""
        core = getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)
        resources, outputs = getattr(core, "resources", None), getattr(core, "outputs_queue", None)
        if resources is None or outputs is None:
            return
        while not self._closed.wait(1.0):
            if getattr(resources, "engine_dead", False):
                outputs.put_nowait(EngineDied("the vLLM engine process died"))
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
                        return
                    self._add(item)
                    block = False
                if self._pending:
                    self._step()
        except BaseException as exc:  # noqa: BLE001 - every waiting shard must hear of it
            self._fail_all(exc)

    def _add(self, item: _Submission) -> None:
        try:
            (request_id,) = self._llm.enqueue([item.prompt], item.params, lora_request=item.lora,
                                              use_tqdm=False)
        except Exception as exc:  # noqa: BLE001 - this request's own error (too long, bad media)
            item.future.set_exception(exc)
            return
        # vLLM returns its internal id ("<ours>-<8 random chars>"); outputs carry ours.
        self._pending[request_id.rsplit("-", 1)[0]] = item.future

    def _step(self) -> None:
        for output in self._llm.llm_engine.step():
            if output.finished:
                future = self._pending.pop(output.request_id, None)
                if future is not None:
                    future.set_result(output)

    def _fail_all(self, exc: BaseException) -> None:
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
