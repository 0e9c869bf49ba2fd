"""The flow's parameters: one pydantic model, so the Prefect UI renders it as a form."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from recipes import RecipeError, get_recipe

DEFAULT_QUESTION = "Describe the content of this image in detail."
DEFAULT_QUESTIONS = {
    "image": DEFAULT_QUESTION,
    "video": "Describe what happens in this video in detail.",
    "multi-image": "Describe the content of these images in detail.",
}
DEFAULT_MAX_IMAGES = 8


class SamplingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(
        None, ge=0.0, le=2.0, description="None: the recipe's value, else 0.0 (greedy)."
    )
    max_tokens: int | None = Field(
        None, ge=1, le=65536, description="None: the recipe's value, else 256."
    )
    seed: int | None = Field(0, description="Per-request sampling seed; fixed by default so reruns agree.")
    ignore_eos: bool = Field(False, description="Always generate max_tokens (benchmarks).")

    def fingerprint_dict(self) -> dict[str, Any]:
        return self.model_dump()


class Partition(BaseModel):
    """Which slice of the listing a child run of a fanned-out job captions (set by the parent)."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(..., ge=0)
    count: int = Field(..., ge=2)
    run_id: str = Field(..., min_length=1, description="The parent run's id: names parts and reports.")
    fingerprint: str | None = Field(None, description="The job's result set (recipe, model, question, sampling).")

    @model_validator(mode="after")
    def _index_in_range(self) -> Partition:
        if self.index >= self.count:
            raise ValueError(f"partition index {self.index} out of range for {self.count} partitions")
        return self


class CaptionJob(BaseModel):
    """Caption every image, video or image group under `source` (or every line of `manifest`)
    with a recipe's model, and write one record per (item, question)."""

    model_config = ConfigDict(extra="forbid")

    source: str | None = Field(
        None, description="s3://bucket/prefix/ or a local folder of media. Leave empty with `manifest`.")
    manifest: str | None = Field(
        None, description="Instead of `source`: a JSON Lines file (s3:// or local), one item per line: "
        '{"id": "...", "media": ["s3://...", "https://...", "relative/key.jpg"], "question": "..."}.')
    output: str = Field(..., description="s3://bucket/prefix/ or a local folder for results.")
    recipe: str = Field("llava", description="Recipe name; `vlm-caption recipes list` shows all.")
    questions: list[str] = Field(
        default_factory=list, description="Asked about every item, one record each (empty: a default "
        "question for the modality). A manifest line's own questions win.")
    modality: Literal["image", "video", "multi-image"] = Field(
        "image", description="What one item is: an image object, a video object, or a group of images "
        "(the objects directly under one folder, or one manifest line).")
    method: Literal["generate", "chat"] = Field(
        "generate", description="`generate` renders the recipe's prompt; `chat` runs LLM.chat with image "
        "parts and the model's chat template (the multi-image example's chat method).")
    num_frames: int = Field(16, ge=1, le=1024, description="Frames sampled uniformly from each video.")
    max_images: int | None = Field(
        None, ge=1, le=256, description="Largest group accepted (multi-image); bigger ones become error "
        f"records, and the engine's per-prompt image limit. Empty: {DEFAULT_MAX_IMAGES}.")
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    shard_size: int = Field(64, ge=1, le=100_000, description="Objects per task run.")
    limit: int | None = Field(None, ge=1, description="Stop after this many listed objects.")
    glob: str | None = Field(None, description="Only keys matching this glob, e.g. '*.jpg'.")
    model: str | None = Field(None, description="Model id or local path instead of the recipe's.")
    skip_model_check: bool = Field(
        False, description="Start without checking the model first (that it can be loaded, and that its "
        "model_type is one the recipe is for): for a model that takes the recipe's prompts under another type.")
    engine_overrides: dict[str, Any] = Field(
        default_factory=dict, description="vLLM engine arguments that win over the recipe's."
    )
    trust_remote_code: bool = Field(
        False, description="Allow recipes whose model runs its repository's own Python code."
    )
    processor_device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="Where the model's HF processor (resize, normalise, patchify) runs: `auto` "
        "puts it on the GPU for recipes with a fast processor checked there (Qwen2-VL, Qwen2.5-VL), "
        "on the CPU otherwise. The manifest's engine section records the choice and why.")
    fan_out: int = Field(
        1, ge=1, le=1024,
        description="Split the listing into this many partitions: this run captions one and starts "
        "the others as child runs of `partition_deployment` (one per GPU worker).",
    )
    partition_deployment: str = Field(
        "vlm-caption/partition", description="Deployment that runs the child partitions of a fan-out."
    )
    partition: Partition | None = Field(
        None, description="Set by a fanned-out parent run; leave empty when starting a job."
    )

    @model_validator(mode="before")
    @classmethod
    def _question_is_one_of_questions(cls, data: Any) -> Any:
        """`question: "..."` (one question, as before) is `questions: ["..."]`."""
        if isinstance(data, dict) and "question" in data:
            data = dict(data)
            question = data.pop("question")
            if question:
                data["questions"] = [question, *data.get("questions", [])]
        return data

    @field_validator("source", "manifest", "output")
    @classmethod
    def _uri(cls, value: str | None) -> str | None:
        from tasks.sources.storage import StorageError

        if value is None:
            return None
        value = value.strip()
        scheme = value.split("://", 1)[0] if "://" in value else ""
        if not value:
            raise ValueError("empty location")
        if scheme and scheme not in ("s3", "s3a", "file"):
            raise StorageError(f"{value}: unsupported scheme {scheme!r}; use s3://bucket/prefix or a folder")
        if scheme in ("s3", "s3a") and not value.split("://", 1)[1].split("/", 1)[0]:
            raise StorageError(f"{value}: missing bucket name; use s3://BUCKET/PREFIX/")
        return value

    @field_validator("questions")
    @classmethod
    def _questions(cls, value: list[str]) -> list[str]:
        if any(not q.strip() for q in value):
            raise ValueError("questions must not be empty strings")
        return list(dict.fromkeys(value))  # a repeated question is asked once

    @model_validator(mode="after")
    def _one_source(self) -> CaptionJob:
        if (self.source is None) == (self.manifest is None):
            raise ValueError("give exactly one of `source` (a folder or bucket prefix) and `manifest` "
                             "(a JSON Lines file of items)")
        if self.method == "chat" and self.modality == "video":
            raise ValueError("method 'chat' sends image parts (the multi-image example's chat method); "
                             "use method 'generate' for video")
        return self

    @property
    def location(self) -> str:
        """Where the items come from: the source, or the manifest."""
        return self.source or self.manifest or ""

    @property
    def image_limit(self) -> int:
        """Images per group: more is an error record; also vLLM's per-prompt limit."""
        return self.max_images or DEFAULT_MAX_IMAGES

    @property
    def questions_to_ask(self) -> tuple[str, ...]:
        return tuple(self.questions) or (DEFAULT_QUESTIONS[self.modality],)

    @model_validator(mode="after")
    def _one_level_of_fan_out(self) -> CaptionJob:
        if self.partition is not None and self.fan_out > 1:
            raise ValueError("a partition run cannot fan out again: set fan_out=1 or leave partition empty")
        return self

    @model_validator(mode="after")
    def _recipe_supports_job(self) -> CaptionJob:
        try:
            get_recipe(self.recipe).prompting(self.modality)
        except RecipeError as exc:
            raise ValueError(str(exc)) from None
        return self
