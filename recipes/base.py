"""What a recipe is: one model family's facts, and how its prompts are built.

Recipes are declarative (frozen pydantic models); building requests from them needs no torch,
no vLLM and no network, so `vlm-caption recipes show` answers in well under a second.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vlm_caption.recipes.errors import UserError

Modality = Literal["image", "video", "multi-image"]
MODALITIES: tuple[Modality, ...] = ("image", "video", "multi-image")
# vLLM's name for the media of each modality (the key of `multi_modal_data`).
MEDIA_KIND: dict[str, str] = {"image": "image", "video": "video", "multi-image": "image"}


EOS_TOKEN = "{eos_token}"


class RecipeError(UserError, ValueError):
    """A recipe cannot do what was asked; the message says what it can do."""


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LoraSpec(Frozen):
    """A LoRA adapter shipped inside the model repository (Phi-4-multimodal's vision LoRA)."""

    name: str
    subdir: str
    max_lora_rank: int


class Prompting(Frozen):
    """How one modality's prompt is built.

    `media` is the placeholder for one item; for multi-image it may use `{i}` (1-based) and the
    items are joined with `joiner`. `template` uses `{media}` and `{question}`:
    - with `chat=None` it is the prompt itself;
    - with `chat="text"` it is the user message's text content, rendered by the model's chat
      template (`{"role": "user", "content": "<image>\\n..."}`);
    - with `chat="parts"` the user content is a list of `{"type": "image"|"video"}` parts followed
      by the question as a text part, and `template` is unused.
    """

    template: str = "{media}{question}"
    media: str = ""
    joiner: str = ""
    chat: Literal["text", "parts"] | None = None
    system: str | None = None
    part_extra: dict[str, Any] = Field(default_factory=dict)
    # A chat template for models whose tokenizer has none (Qwen-VL-Chat uses ChatML).
    chat_template: str | None = None
    # Facts that differ from the recipe's defaults for this modality.
    model: str | None = None
    engine_args: dict[str, Any] = Field(default_factory=dict)
    stop_token_ids: tuple[int, ...] | None = None
    stop_tokens: tuple[str, ...] | None = None

    def text(self, question: str, count: int) -> str:
        media = self.joiner.join(self.media.replace("{i}", str(i)) for i in range(1, count + 1))
        return self.template.replace("{media}", media).replace("{question}", question)

    def messages(self, question: str, count: int, kind: str) -> list[dict[str, Any]]:
        if self.chat == "parts":
            content: Any = [{"type": kind, **self.part_extra} for _ in range(count)]
            content.append({"type": "text", "text": question})
        else:
            content = self.text(question, count)
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": content}]


class Recipe(Frozen):
    """One model family's facts, re-expressed from vLLM's vision-language examples."""

    name: str
    model: str
    family: str
    aliases: tuple[str, ...] = ()
    # The checkpoint `model_type`s (config.json) this recipe's prompts are for; a job whose model
    # is of another type is refused before the engine starts. Empty: not checked.
    model_types: tuple[str, ...] = ()
    # Engine arguments that belong to the model (not to the GPU it runs on).
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # The context length the example runs the model with. It bounds KV-cache memory for the
    # prompts this model's processor produces; the engine clamps it to the checkpoint's limit.
    max_model_len: int | None = None
    image: Prompting | None = None
    video: Prompting | None = None
    multi_image: Prompting | None = None
    stop_token_ids: tuple[int, ...] | None = None
    # Token strings resolved through the tokenizer; unknown ones are dropped (as the examples
    # do). EOS_TOKEN stands for the tokenizer's own end-of-sequence token.
    stop_tokens: tuple[str, ...] | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)
    lora: LoraSpec | None = None
    needs_video_metadata: bool = False
    # The model's HF processor is a fast (torch) one that takes `device`, and its GPU output was
    # checked against its CPU output (tests/gpu_processor_check.py): on a GPU it runs there.
    processor_on_gpu: bool = False
    notes: str = ""
    # Set when the vLLM this project pins no longer implements the model's architecture (vLLM's own
    # `_PREVIOUSLY_SUPPORTED_MODELS`): a job is refused up front with this text, not by a traceback
    # from the engine. The recipe stays, with its prompts, for users of an older vLLM.
    removed_from_vllm: str = ""

    # ---- derived facts -------------------------------------------------------------------
    @property
    def modalities(self) -> tuple[Modality, ...]:
        return tuple(m for m in MODALITIES if self.prompting_or_none(m) is not None)

    @property
    def needs_remote_code(self) -> bool:
        prompts = [p.engine_args for p in (self.image, self.video, self.multi_image) if p is not None]
        return any(bool(args.get("trust_remote_code")) for args in (self.engine_args, *prompts))

    @property
    def processor_on_gpu_host(self) -> bool:
        """Whether `--processor-device auto` runs the model's processor on a GPU host's GPU: a
        fast processor checked there, and not the model repository's own code."""
        return self.processor_on_gpu and not self.needs_remote_code

    @property
    def gpus_needed(self) -> int:
        return int(self.engine_args.get("tensor_parallel_size", 1))

    def prompting_or_none(self, modality: str) -> Prompting | None:
        return {"image": self.image, "video": self.video, "multi-image": self.multi_image}.get(modality)

    def check_runnable(self) -> None:
        if self.removed_from_vllm:
            raise RecipeError(f"recipe {self.name!r} cannot run on this vLLM: {self.removed_from_vllm}")

    def prompting(self, modality: str) -> Prompting:
        spec = self.prompting_or_none(modality)
        if spec is None:
            raise RecipeError(
                f"recipe {self.name!r} does not support modality {modality!r}; "
                f"it supports: {', '.join(self.modalities)}"
            )
        return spec

    def model_for(self, modality: str, override: str | None = None) -> str:
        return override or self.prompting(modality).model or self.model

    def uses_chat_template(self, modality: str) -> bool:
        return self.prompting(modality).chat is not None

    def stops_for(self, modality: str) -> tuple[tuple[int, ...] | None, tuple[str, ...] | None]:
        spec = self.prompting(modality)
        if spec.stop_token_ids is not None or spec.stop_tokens is not None:
            return spec.stop_token_ids, spec.stop_tokens
        return self.stop_token_ids, self.stop_tokens

    def engine_args_for(
        self, modality: str, *, images: int = 1, model: str | None = None
    ) -> dict[str, Any]:
        """The model's engine arguments for one modality, before hardware sizing."""
        spec = self.prompting(modality)
        args: dict[str, Any] = {"model": self.model_for(modality, model)}
        args.update(self.engine_args)
        if self.max_model_len is not None:
            args["max_model_len"] = self.max_model_len
        args.update(spec.engine_args)
        count = images if modality == "multi-image" else 1
        args["limit_mm_per_prompt"] = {MEDIA_KIND[modality]: count}
        if self.lora is not None:
            args.update(enable_lora=True, max_lora_rank=self.lora.max_lora_rank)
        # A modality sets an inherited argument to None to leave it at vLLM's default.
        return {key: value for key, value in args.items() if value is not None}
