"""The only module that talks to vLLM.

`get_engine(EngineSpec(...))` returns the process's `CaptionEngine`: one `vllm.LLM`, built once
from the recipe's engine arguments, sized for the hardware at hand, plus the caller's
overrides, and reused by every shard this worker process handles.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipes import RecipeError, get_recipe
from recipes.base import MEDIA_KIND
from recipes.requests import render_chat, resolve_stop_ids
from tasks.engine.arguments import EngineSpec, engine_args
from tasks.engine.feed import EngineDied, EngineFeed
from tasks.results.records import GenerationOutput

# Importing vLLM otherwise runs logging.config.dictConfig, which shuts down every handler in the
# process -- Prefect's API log handler included, whose flush then deadlocks inside a running
# flow. With this, vLLM's warnings still reach the root logger that Prefect configures.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

DEFAULT_TEMPERATURE = 0.0
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class Sampling:
    temperature: float | None = None
    max_tokens: int | None = None
    seed: int | None = 0
    ignore_eos: bool = False


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
        from vllm import LLM
        from vllm.platforms import current_platform

        self.spec = spec
        self.recipe = get_recipe(spec.recipe)
        self.prompting = self.recipe.prompting(spec.modality)
        self.args = engine_args(spec, self.recipe, on_cpu=current_platform.is_cpu())
        self.model = self.args["model"]
        started = time.perf_counter()
        self.llm = LLM(**self.args)
        self.startup_s = time.perf_counter() - started
        self.tokenizer = self.llm.get_tokenizer()
        self.stop_token_ids = resolve_stop_ids(self.tokenizer, self.recipe, spec.modality)
        self.lora_request = self._lora_request()
        self._feed: EngineFeed | None = None
        self._batch_lock = threading.Lock()
        self.dead = False

    def sizing(self) -> dict[str, Any]:
        """How vLLM sized this engine for the device present (recipes leave sizing to vLLM,
        which picks batch limits by device memory and fills `gpu_memory_utilization` of it
        with KV cache; `engine_overrides` changes any of it). Written into the manifest."""
        from vllm.platforms import current_platform

        config = self.llm.llm_engine.vllm_config
        cache, scheduler = config.cache_config, config.scheduler_config
        device: dict[str, Any] = {"device": current_platform.device_type}
        with contextlib.suppress(Exception):  # not every platform can name itself
            device["device_name"] = current_platform.get_device_name()
            device["device_memory_gib"] = round(current_platform.get_device_total_memory() / 2**30, 1)
        blocks = cache.num_gpu_blocks or 0
        return {**device, "max_num_seqs": scheduler.max_num_seqs,
                "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                "max_model_len": config.model_config.max_model_len,
                "gpu_memory_utilization": cache.gpu_memory_utilization,
                "kv_cache_blocks": blocks, "kv_cache_tokens": blocks * cache.block_size}

    def prompt_for(self, question: str, count: int = 1) -> str:
        """The exact prompt text for one item (the chat template rendered if needed)."""
        if self.prompting.chat is None:
            return self.prompting.text(question, count)
        messages = self.prompting.messages(question, count, MEDIA_KIND[self.spec.modality])
        return render_chat(self.tokenizer, messages, self.prompting.chat_template)

    def sampling_params(self, sampling: Sampling):
        from vllm import SamplingParams

        params: dict[str, Any] = {"temperature": DEFAULT_TEMPERATURE, "max_tokens": DEFAULT_MAX_TOKENS}
        params.update(self.recipe.sampling)
        if sampling.temperature is not None:
            params["temperature"] = sampling.temperature
        if sampling.max_tokens is not None:
            params["max_tokens"] = sampling.max_tokens
        return SamplingParams(seed=sampling.seed, stop_token_ids=self.stop_token_ids,
                              ignore_eos=sampling.ignore_eos, **params)

    def run(self, requests: list[EngineRequest], sampling: Sampling,
            method: str = "generate") -> list[GenerationOutput]:
        """Run a batch with `LLM.generate` or `LLM.chat`; a request vLLM rejects fails alone."""
        if not requests:
            return []
        params = self.sampling_params(sampling)
        if method == "generate":
            return self._feed_all(requests, params)
        self._check_chat_template()
        call = self._chat
        with self._batch_lock:  # LLM.chat runs the engine to completion: one caller at a time
            try:
                return [_output(o) for o in call(requests, params)]
            except Exception:  # one bad request poisons a batch call: retry one by one to isolate it
                return [self._run_one(call, r, params) for r in requests]

    def _feed_all(self, requests: list[EngineRequest], params) -> list[GenerationOutput]:
        """Hand the requests to the engine's continuous feed and wait for this batch's own."""
        with self._batch_lock:
            if self._feed is None:
                self._feed = EngineFeed(self.llm)
        lora = self.lora_request
        futures = [self._feed.submit(self._generate_input(r), params, lora) for r in requests]
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

    def _generate_input(self, request: EngineRequest) -> dict[str, Any]:
        kind = MEDIA_KIND[self.spec.modality]
        return {"prompt": self.prompt_for(request.question, request.count),
                "multi_modal_data": {kind: request.media}, "multi_modal_uuids": {kind: request.uuids}}

    def _run_one(self, call, request: EngineRequest, params) -> GenerationOutput:
        try:
            return _output(call([request], params)[0])
        except Exception as exc:  # noqa: BLE001 - recorded on the item, never dropped
            if type(exc).__name__ == "EngineDeadError":  # not this item's fault: retry the shard
                self.dead = True
                raise EngineDied(str(exc)) from exc
            return GenerationOutput(None, None, 0, 0, error=f"{type(exc).__name__}: {exc}")

    def _chat(self, requests: list[EngineRequest], params):
        """The multi-image example's chat method: the question, then one image part per picture,
        rendered by vLLM with the model's (or the recipe's) chat template."""
        conversations = []
        for r in requests:
            images = r.media if isinstance(r.media, list) else [r.media]
            uuids = r.uuids if isinstance(r.uuids, list) else [r.uuids]
            parts = [{"type": "image_pil", "image_pil": image, "uuid": uuid} for image, uuid in zip(images, uuids)]
            conversations.append([{"role": "user", "content": [{"type": "text", "text": r.question}, *parts]}])
        return self.llm.chat(conversations, params, use_tqdm=False, lora_request=self._loras(len(conversations)),
                             chat_template=self.prompting.chat_template)

    def _check_chat_template(self) -> None:
        """The chat method renders through a chat template: without one every item would fail."""
        if self.prompting.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise RecipeError(
                f"the chat method needs a chat template, and {self.model}'s tokenizer has none "
                f"(recipe {self.spec.recipe!r} gives none either); use method 'generate'")

    def _loras(self, count: int):
        return [self.lora_request] * count if self.lora_request else None

    def release(self) -> None:
        if self._feed is not None:
            self._feed.close()
        self._feed = None
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


def get_engine(spec: EngineSpec) -> CaptionEngine:
    """The process's engine for `spec`, built on first use and reused afterwards.

    A worker serves one model at a time: asking for another spec releases the old engine. An
    engine whose process died (killed, out of memory) is replaced by a new one.
    """
    with _LOCK:
        engine = _ENGINES.get(spec)
        if engine is None or engine.dead:
            for old in list(_ENGINES):
                _ENGINES.pop(old).release()
            engine = _ENGINES[spec] = CaptionEngine(spec)
        return engine
