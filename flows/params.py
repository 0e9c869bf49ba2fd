"""The flow's parameters: one pydantic model, so the Prefect UI renders it as a form."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from vlm_caption.recipes import Recipe, RecipeError, get_recipe
from vlm_caption.tasks.sources.registry import SOURCE_FORMATS, formats_help, reader_class
from vlm_caption.tasks.sources.storage import check_location
from vlm_caption.tasks.sources.watermark import check_modified_since

DEFAULT_QUESTIONS = {
    "image": "Describe the content of this image in detail.",
    "video": "Describe what happens in this video in detail.",
    "multi-image": "Describe the content of these images in detail.",
}
DEFAULT_MAX_IMAGES = 8

# `json_schema="tags"`: the common tagging job's schema.
TAGS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
                   "caption": {"type": "string"}},
    "required": ["tags"],
}
BUILTIN_SCHEMAS = {"tags": TAGS_SCHEMA}


def resolve_json_schema(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """A built-in schema's name or a JSON Schema object, as a checked schema (ValueError if not one)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in BUILTIN_SCHEMAS:
            raise ValueError(f"{value!r} is not a built-in schema ({', '.join(BUILTIN_SCHEMAS)}); "
                             "give a JSON Schema object")
        return json.loads(json.dumps(BUILTIN_SCHEMAS[value]))  # a copy
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(value)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ValueError(f"not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else "")) from None
    return value


class SamplingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(
        None, ge=0.0, le=2.0, description="Empty: the recipe's value, else 0.0 (greedy)."
    )
    max_tokens: int | None = Field(
        None, ge=1, le=65536, description="Empty: the recipe's value, else 256."
    )
    seed: int | None = Field(0, description="Per-request sampling seed; fixed by default so reruns agree.")
    ignore_eos: bool = Field(False, description="Always generate max_tokens (benchmarks).")


class Partition(BaseModel):
    """Which slice of the listing a child run of a fanned-out job captions (set by the parent)."""

    model_config = ConfigDict(extra="forbid")

    index: int = Field(..., ge=0)
    count: int = Field(..., ge=2)
    run_id: str = Field(..., min_length=1, description="The parent run's id: names parts and reports.")
    fingerprint: str | None = Field(None, description="The job's result set (recipe, model, question, sampling).")
    engine_first: bool = Field(False, description="The parent found work at once (no earlier result, or objects "
                               "after where the last listing ended): start the engine at once.")

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
    shard_size: int = Field(64, ge=1, le=100_000, description="Objects per results part.")
    limit: int | None = Field(None, ge=1, description="Stop after this many listed objects.")
    glob: str | None = Field(None, description="Only keys matching this glob, e.g. '*.jpg'.")
    source_format: Literal[SOURCE_FORMATS] = Field(  # tasks/sources/registry.py
        "auto", description=f"What `source` holds: {formats_help()}")
    modified_since: Annotated[str | None, AfterValidator(check_modified_since)] = Field(
        None, description="Only objects modified after this: a time (2026-11-20T03:00:00Z; UTC without a "
        "zone), a duration back from the run's start (26h, 2d), or `auto`: after the watermark the last "
        "completed run of this job left in the output (items that failed retryably are listed again). "
        "Media files and inventory sources.")
    column: str | None = Field(
        None, description="Parquet: the column holding each row's media (URLs, s3:// URIs, paths or image "
        "bytes); empty: the first of image, jpg, png, webp, url, URL, uri, path. Other columns are kept.")
    follow_links: bool = Field(False, description="A local folder source: read its symbolic links that lead "
                               "outside it (off: each is a `bad_input` record, its target never read).")
    gallery_items: int = Field(
        200, ge=0, le=5000, description="Items shown on the run's HTML gallery (a sample; 0: no gallery).")
    model: str | None = Field(None, description="Model id or local path instead of the recipe's.")
    skip_model_check: bool = Field(
        False, description="Start without checking the model first (that it can be loaded, and that its "
        "model_type is one the recipe is for): for a model that takes the recipe's prompts under another type.")
    engine_overrides: dict[str, Any] = Field(default_factory=dict, description="vLLM engine arguments that win "
                                             "over the recipe's.")
    trust_remote_code: bool = Field(False, description="Allow recipes whose model runs its repository's own "
                                    "Python code.")
    processor_device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="Where the model's HF processor (resize, normalise, patchify) runs: `auto` "
        "puts it on the GPU for recipes with a fast processor checked there (Qwen2-VL, Qwen2.5-VL), "
        "on the CPU otherwise. The manifest's engine section records the choice and why.")
    fan_out: int = Field(1, ge=1, le=1024, description="Split the listing into this many partitions: this run "
                         "captions one and starts the others as child runs of `partition_deployment` (one per "
                         "GPU worker).")
    partition_deployment: str = Field("vlm-caption/partition", description="Deployment that runs the child "
                                      "partitions of a fan-out.")
    partition: Partition | None = Field(None, description="Set by a fanned-out parent run; leave empty when "
                                        "starting a job.")
    json_schema: Annotated[dict[str, Any] | str | None, AfterValidator(resolve_json_schema)] = Field(
        None, description="Structured output: every answer is JSON matching this JSON Schema (or `tags`: "
        "a built-in {tags: [...], caption} schema); the record's `structured` holds it parsed.")
    regex: str | None = Field(None, description="Structured output: every answer matches this regular expression.")
    choice: list[str] | None = Field(None, description="Structured output: every answer is one of these strings.")
    retry_looping: float | None = Field(
        None, gt=0, description="Ask once more, with this vLLM `repetition_penalty` (1.3 is a fair start), for each "
        "caption that loops or is empty (its record's `quality` flags), and keep the better answer (the record's "
        "`retried_for`: the first answer's flags). Empty: not asked again.")
    dedup: bool = Field(
        True, description="Caption each distinct media once: an (item, question) whose bytes (sha256, or listed S3 "
        "ETags that are MD5s) were asked already, in this run or an earlier one of the job, takes that answer with "
        "no request, its record's `duplicate_of` naming the item captioned. Off: every item is asked.")
    _recipe: Recipe | None = PrivateAttr(None)  # `recipe` looked up, once: `resolved_recipe`

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
        return None if value is None else check_location(value)

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
        reader = None if self.source_format == "auto" else reader_class(self.source_format)
        if reader is not None and reader.name != "files" and self.manifest is not None:
            raise ValueError(f"source_format {self.source_format!r} reads `source`, not a manifest")
        if reader is not None and not reader.groups and self.modality == "multi-image":
            raise ValueError(f"a {self.source_format} item is one medium (a sample, a row, a line): "
                             "use modality image or video")
        if self.modified_since is not None and (self.manifest is not None or (reader and not reader.timed)):
            raise ValueError("modified_since is for a folder or bucket of media files and S3 Inventory reports")
        if self.column is not None and reader is not None and not reader.takes_column:
            raise ValueError("column is for Parquet sources (source_format parquet)")
        if self.method == "chat" and self.modality == "video":
            raise ValueError("method 'chat' sends image parts (the multi-image example's chat method); "
                             "use method 'generate' for video")
        if self.partition is not None and self.fan_out > 1:
            raise ValueError("a partition run cannot fan out again: set fan_out=1 or leave partition empty")
        given = [name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of json_schema, regex and choice (got {', '.join(given)})")
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

    @field_validator("regex")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        try:
            return value if value is None else re.compile(value).pattern
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None

    @field_validator("choice")
    @classmethod
    def _choice(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            value = list(dict.fromkeys(value))
            if not value or any(not c for c in value):
                raise ValueError("choice needs at least one non-empty string")
        return value

    @property
    def structured_output(self) -> dict[str, Any] | None:
        """vLLM's structured-output constraint (`StructuredOutputsParams` fields), or None for prose."""
        if self.json_schema is not None:
            # (vLLM 0.26 ignores a request's disable_any_whitespace: compact JSON is the engine
            # argument structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": true}.)
            return {"json": self.json_schema}
        if self.regex is not None:
            return {"regex": self.regex}
        if self.choice is not None:
            return {"choice": list(self.choice)}
        return None

    @model_validator(mode="after")
    def _recipe_supports_job(self) -> CaptionJob:
        try:
            recipe = get_recipe(self.recipe)
            recipe.prompting(self.modality)
            recipe.check_runnable()
        except RecipeError as exc:
            raise ValueError(str(exc)) from None
        self._recipe = recipe
        return self

    @property
    def resolved_recipe(self) -> Recipe:
        """The recipe `recipe` names, found when the job was made (its one lookup by name)."""
        return self._recipe
