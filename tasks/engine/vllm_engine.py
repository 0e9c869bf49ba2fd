"""The only module that talks to vLLM.

`get_engine(spec)` returns the process's `CaptionEngine`: one vLLM `AsyncLLM`, built once from the
engine arguments the run's plan resolved (`EngineSpec`), completed for the hardware at hand, and
reused by every shard this worker process handles.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlm_caption.recipes import RecipeError
from vlm_caption.recipes.base import MEDIA_KIND
from vlm_caption.recipes.requests import prompt_text, render_chat, resolve_stop_ids
from vlm_caption.tasks.engine import vllm_api
from vlm_caption.tasks.engine.arguments import EngineSpec, eager_engine_processes, engine_plan
from vlm_caption.tasks.engine.feed import EngineDied, EngineFeed
from vlm_caption.tasks.engine.vllm_import import ensure_vllm_imported
from vlm_caption.tasks.records import GenerationOutput


@dataclass(frozen=True)
class Sampling:
    temperature: float | None = None
    max_tokens: int | None = None
    seed: int | None = 0
    ignore_eos: bool = False
    # A structured-output constraint: `StructuredOutputsParams` fields ({"json": schema},
    # {"regex": ...} or {"choice": [...]}, see `CaptionJob.structured_output`), or None for prose.
    structured: dict[str, Any] | None = field(default=None, hash=False)
    # vLLM's repetition penalty (1.0: none); the re-ask of a looping caption sets it (tasks/engine/steps.py).
    repetition_penalty: float | None = None


@dataclass
class EngineRequest:
    """One request: a question about one item's media.

    `media` is what vLLM takes for the modality (an image, a list of images, video frames or
    `(frames, metadata)`); `uuids` are content hashes in the same shape, so vLLM's processor
    cache recognises media repeated across questions."""

    question: str
    media: Any
    uuids: str | list[str]
    count: int = 1  # images in the prompt (multi-image)


class CaptionEngine:
    def __init__(self, spec: EngineSpec):
        ensure_vllm_imported()  # with VLLM_CONFIGURE_LOGGING set (tasks/engine/vllm_import.py)
        from vllm.platforms import current_platform

        from vlm_caption.tasks.observability import get_logger, phase

        self.spec = spec
        self.recipe = spec.recipe
        self.prompting = self.recipe.prompting(spec.modality)
        self.args, self.processor = engine_plan(spec, on_cpu=current_platform.is_cpu())
        eager_engine_processes(self.args, on_cpu=current_platform.is_cpu())
        self.model = self.args["model"]
        # Where the model's processor runs, and why: a CPU placement on a GPU host can hold the GPU back.
        get_logger().info("model processor placed", device=self.processor.device, reason=self.processor.reason)
        phase("building the engine", model=self.model)
        started = time.perf_counter()
        self._feed = EngineFeed(lambda: vllm_api.build_async_engine(self.args))
        self.llm = self._feed.llm
        self.startup_s = time.perf_counter() - started
        phase("engine ready", seconds=round(self.startup_s, 1))
        self.ready_at = time.time()  # when it could take requests (epoch seconds; the bench measures from it)
        self.tokenizer = self.llm.get_tokenizer()
        self.stop_token_ids = resolve_stop_ids(self.tokenizer, self.recipe, spec.modality)
        self.lora_request = self._lora_request()
        self.dead = False

    def sizing(self) -> dict[str, Any]:
        """How vLLM sized this engine for the device present (recipes leave sizing to vLLM,
        which picks batch limits by device memory and fills `gpu_memory_utilization` of it
        with KV cache; `engine_overrides` changes any of it). Written into the manifest."""
        from vllm.platforms import current_platform

        device: dict[str, Any] = {"device": current_platform.device_type}
        with contextlib.suppress(Exception):  # not every platform can name itself
            device["device_name"] = current_platform.get_device_name()
            device["device_memory_gib"] = round(current_platform.get_device_total_memory() / 2**30, 1)
        return {**device, **vllm_api.engine_sizing(self.llm), **self.processor.manifest()}

    def prompt_for(self, question: str, count: int = 1) -> str:
        """The exact prompt text for one item (the chat template rendered if needed)."""
        return prompt_text(self.prompting, self.tokenizer, question, count, MEDIA_KIND[self.spec.modality])

    def sampling_params(self, sampling: Sampling):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # Greedy and 256 tokens unless the recipe says otherwise.
        params: dict[str, Any] = {"temperature": 0.0, "max_tokens": 256, **self.recipe.sampling}
        for key in ("temperature", "max_tokens", "repetition_penalty"):  # the job's, where it set them
            if getattr(sampling, key) is not None:
                params[key] = getattr(sampling, key)
        if sampling.structured is not None:
            from vllm.sampling_params import StructuredOutputsParams

            params["structured_outputs"] = StructuredOutputsParams(**sampling.structured)
        return SamplingParams(seed=sampling.seed, stop_token_ids=self.stop_token_ids,
                              ignore_eos=sampling.ignore_eos, output_kind=RequestOutputKind.FINAL_ONLY, **params)

    def run(self, requests: list[EngineRequest], sampling: Sampling,
            method: str = "generate") -> list[GenerationOutput]:
        """Hand the requests to the engine's continuous feed and wait for these; a request vLLM
        rejects fails alone. `method`: the examples' `generate` (the recipe's prompt) or `chat`."""
        if not requests:
            return []
        no_template = self.prompting.chat_template is None and not getattr(self.tokenizer, "chat_template", None)
        if method == "chat" and no_template:  # chat renders through a chat template: every item would fail
            raise RecipeError(
                f"the chat method needs a chat template, and {self.model}'s tokenizer has none "
                f"(recipe {self.recipe.name!r} gives none either); use method 'generate'")
        params = self.sampling_params(sampling)
        # A rendered chat holds its special tokens already, as `LLM.chat` tokenizes it.
        tokenization = {"add_special_tokens": False} if method == "chat" else None
        futures = [self._feed.submit(self._prompt(r, method), params, self.lora_request, tokenization)
                   for r in requests]
        outputs = []
        for future in futures:
            try:
                outputs.append(_output(future.result()))
            except EngineDied:
                self.dead = True  # get_engine builds a new one for the shard's retry
                raise
            except Exception as exc:  # noqa: BLE001 - this request's own error, recorded on its item
                outputs.append(GenerationOutput(None, None, 0, 0, error=f"{type(exc).__name__}: {exc}"))
        return outputs

    def _prompt(self, request: EngineRequest, method: str) -> dict[str, Any]:
        """The request as vLLM's `PromptType`: the recipe's prompt (`generate`), or (`chat`, the
        multi-image example's) the question then one image part per picture, rendered with the
        model's (or the recipe's) chat template as `LLM.chat` renders it."""
        kind = MEDIA_KIND[self.spec.modality]
        if method == "generate":
            text = self.prompt_for(request.question, request.count)
        else:
            content = [{"type": "text", "text": request.question}, *([{"type": "image"}] * request.count)]
            text = render_chat(self.tokenizer, [{"role": "user", "content": content}], self.prompting.chat_template)
        return {"prompt": text, "multi_modal_data": {kind: request.media}, "multi_modal_uuids": {kind: request.uuids}}

    def release(self) -> None:
        """Stop the feed and shut vLLM's engine process down."""
        self._feed.close()
        self.llm = None

    def _lora_request(self):
        if self.recipe.lora is None:
            return None
        from vllm.lora.request import LoRARequest

        root = Path(self.model)
        if not root.exists():
            from huggingface_hub import snapshot_download

            root = Path(snapshot_download(self.model))
        return LoRARequest(self.recipe.lora.name, 1, str(root / self.recipe.lora.subdir))


def _output(request_output) -> GenerationOutput:
    completion = request_output.outputs[0]
    return GenerationOutput(
        text=completion.text,
        finish_reason=completion.finish_reason,
        prompt_tokens=len(request_output.prompt_token_ids or []),
        output_tokens=len(completion.token_ids or []),
        prompt=request_output.prompt,
    )


_ENGINES: dict[EngineSpec, CaptionEngine] = {}
_LOCK = threading.Lock()
_EARLY: dict[EngineSpec, Future] = {}  # engines being built ahead of their first use
_EARLY_LOCK = threading.Lock()  # not _LOCK, which a build holds throughout


def start_engine_early(spec: EngineSpec) -> None:
    """Build the process's engine for `spec` on a thread of its own, while the caller goes on
    (Prefect's start, the flow run, the listing). The first `get_engine(spec)` waits for it and
    raises what the build raised; a second call for the same spec does nothing."""
    with _EARLY_LOCK:
        if spec in _ENGINES or spec in _EARLY:
            return
        building = _EARLY[spec] = Future()

    def build() -> None:
        try:
            building.set_result(_engine_for(spec))
        except BaseException as exc:  # noqa: BLE001 - handed to the first get_engine, which raises it
            building.set_exception(exc)

    threading.Thread(target=build, name="engine-start", daemon=True).start()


def building() -> bool:
    """Whether an engine is being built (or let go of) in this process now."""
    return _LOCK.locked()


def discard_early_engine() -> bool:
    """A run that found nothing to do lets go of the engine it started early: released as soon
    as its build ends (a build cannot be stopped half-way), without waiting for it here. True if
    there was one."""
    with _EARLY_LOCK:
        early = list(_EARLY.values())
        _EARLY.clear()
    for building in early:
        building.add_done_callback(lambda done: done.exception() is None and release_engines())
    return bool(early)


def get_engine(spec: EngineSpec) -> CaptionEngine:
    """The process's engine for `spec`, built on first use (or by `start_engine_early`) and
    reused afterwards. A worker serves one model at a time: asking for another spec releases the
    old engine. An engine whose process died (killed, out of memory) is replaced by a new one."""
    with _EARLY_LOCK:
        building = _EARLY.pop(spec, None)
    if building is not None:
        building.result()  # the early build's error is this call's
    return _engine_for(spec)


def _engine_for(spec: EngineSpec) -> CaptionEngine:
    with _LOCK:
        engine = _ENGINES.get(spec)
        if engine is None or engine.dead:
            _release_all()
            engine = _ENGINES[spec] = CaptionEngine(spec)
            # Registered after multiprocessing's own exit hook, so it runs first: the engine
            # process is shut down cleanly before multiprocessing would terminate it.
            atexit.unregister(release_engines)
            atexit.register(release_engines)
        return engine


def release_engines() -> None:
    """Let go of this process's engine (the next shard builds a new one)."""
    with _LOCK:
        _release_all()


def _release_all() -> None:
    for old in list(_ENGINES):
        _ENGINES.pop(old).release()
