"""vLLM's request rendering, in the engine's process or in a pool of processes.

Before the engine core sees a request, vLLM *renders* it: tokenizes the prompt (or applies the
chat template) and runs the model's HF processor over its media. Offline `LLM` does that in the
caller's process, one request at a time, under the same GIL as the feed that steps the engine
and the shards that fetch and decode. `RenderPool` runs the same renderer, built from the
engine's own `VllmConfig`, in worker processes (vLLM's scale-out "render" servers do the same
over HTTP), and hands the feed finished `EngineInput`s that `LLMEngine.add_request` takes as they
are. The pool needs vLLM's multimodal processor cache off: that cache is a sender/receiver pair
between one renderer and the engine core, and several renderers would break the pairing.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RenderJob:
    """What becomes one vLLM request: a completion prompt (the `generate` method) or one chat
    conversation (the `chat` method) rendered with `chat_template` (None: the tokenizer's)."""

    prompt: dict[str, Any] | None = None
    conversation: list[dict[str, Any]] | None = None
    chat_template: str | None = None


class RenderError(RuntimeError):
    """A request vLLM refused to render (too long for the context, media the processor rejects).
    Raised with the original's type and text: vLLM's exceptions do not always cross processes."""


def render(renderer, job: RenderJob):
    """`job` as vLLM's `LLM.enqueue` / `LLM.enqueue_chat` render it: an `EngineInput`."""
    if job.prompt is not None:
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        (rendered,) = renderer.render_cmpl([parse_model_prompt(renderer.model_config, job.prompt)],
                                           renderer.default_cmpl_tok_params)
        return rendered
    from vllm.renderers import ChatParams, merge_kwargs
    from vllm.utils.mistral import is_mistral_tokenizer

    tokenize = is_mistral_tokenizer(renderer.tokenizer) or renderer.model_config.enable_prompt_embeds
    template_kwargs = merge_kwargs(None, {"add_generation_prompt": True, "continue_final_message": False,
                                          "tools": None, "tokenize": tokenize})
    params = ChatParams(chat_template=job.chat_template, chat_template_content_format="auto",
                        chat_template_kwargs=template_kwargs)
    _, (rendered,) = renderer.render_chat([job.conversation], params, renderer.default_chat_tok_params)
    return rendered


# ---- the worker processes -------------------------------------------------------------------
_RENDERER = None


def _start_worker(config) -> None:
    global _RENDERER
    import torch

    torch.set_num_threads(1)  # one request at a time per process; the pool is the parallelism
    from vllm.renderers import renderer_from_config

    _RENDERER = renderer_from_config(config)


def _ready() -> int:
    return os.getpid()


def _render_in_worker(job: RenderJob):
    try:
        return render(_RENDERER, job)
    except Exception as exc:  # noqa: BLE001 - re-raised as a plain, picklable error
        raise RenderError(f"{type(exc).__name__}: {exc}") from None


class RenderPool:
    """`processes` renderers for one engine. Until every worker has started (spawn, import vLLM,
    load the processor: seconds, overlapped with the first shards), `ready` is False and the
    feed renders in its own process instead, so the GPU never waits for the pool."""

    def __init__(self, config, processes: int):
        self.processes = processes
        self.submitted = 0  # requests handed to the pool (the rest were rendered in-process)
        # spawn: the engine's process holds threads (vLLM's client, Prefect); forking them is unsafe.
        self._pool = ProcessPoolExecutor(max_workers=processes, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_start_worker, initargs=(config,))
        self._started = threading.Event()
        warm = [self._pool.submit(_ready) for _ in range(processes)]  # starts every worker now
        threading.Thread(target=self._wait_started, args=(warm,), name="render-pool-start", daemon=True).start()
        atexit.register(self.close)

    @property
    def ready(self) -> bool:
        return self._started.is_set()

    def _wait_started(self, warm: list[Future]) -> None:
        try:
            for future in warm:
                future.result()
        except Exception as exc:  # noqa: BLE001 - a pool that cannot start is never used: in-process rendering
            from tasks.observability import get_logger

            get_logger().warning("render pool did not start; prompts are rendered in the run's own process "
                                 "(slower)", error=f"{type(exc).__name__}: {exc}")
            return
        self._started.set()

    def submit(self, job: RenderJob) -> Future:
        future = self._pool.submit(_render_in_worker, job)
        self.submitted += 1
        return future

    def close(self) -> None:
        self._started.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
