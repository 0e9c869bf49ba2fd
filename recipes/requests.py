"""Turn a recipe plus questions into the requests vLLM receives (prompt text or chat messages).

Pure Python: the only optional heavy import is a local tokenizer, used to render chat templates
and resolve stop-token strings when one is available.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from vlm_caption.recipes.base import EOS_TOKEN, MEDIA_KIND, Recipe, RecipeError


class PromptRequest(BaseModel):
    """One prompt for one media item (or one set of images for multi-image)."""

    model_config = ConfigDict(frozen=True)

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None


class RecipeRequests(BaseModel):
    """What a recipe builds for some questions: the `recipes show` contract (its fields in this
    order, those that are None left out)."""

    recipe: str
    model: str
    modality: str
    engine_args: dict[str, Any]
    requests: list[PromptRequest]
    method: str = "generate"  # a recipe's prompt is for LLM.generate (a job may ask for `chat`)
    stop_token_ids: list[int] | None = None
    stop_tokens: list[str] | None = None
    chat_template: str | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


def load_local_tokenizer(model: str, trust_remote_code: bool = False):
    """The model's tokenizer if it is on local disk, else None (never downloads)."""
    path = Path(model)
    if not (path / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def prompt_text(prompting, tokenizer, question: str, count: int, media_kind: str) -> str:
    """The exact prompt for one request: the recipe's template, or its chat messages rendered
    with the tokenizer's (or the recipe's) chat template."""
    if prompting.chat is None:
        return prompting.text(question, count)
    return render_chat(tokenizer, prompting.messages(question, count, media_kind), prompting.chat_template)


def render_chat(tokenizer, messages: list[dict[str, Any]], chat_template: str | None) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=chat_template
    )


def resolve_stop_ids(tokenizer, recipe: Recipe, modality: str) -> list[int] | None:
    """Stop token ids for generation: literal ids plus token strings resolved by the tokenizer."""
    ids, tokens = recipe.stops_for(modality)
    out = list(ids or [])
    if tokens and tokenizer is not None:
        unk = getattr(tokenizer, "unk_token_id", None)
        for token in tokens:
            tid = tokenizer.eos_token_id if token == EOS_TOKEN else tokenizer.convert_tokens_to_ids(token)
            if tid is not None and tid != unk:
                out.append(int(tid))
    return out or None


def build_requests(
    recipe: Recipe,
    modality: str,
    questions: list[str],
    *,
    images: int = 1,
    model: str | None = None,
    tokenizer: Any = None,
) -> RecipeRequests:
    """Build one request per question (one in total for multi-image, as the example does)."""
    spec = recipe.prompting(modality)
    if not questions:
        raise RecipeError("at least one question is needed")
    if modality == "multi-image":
        if images < 1:
            raise RecipeError("multi-image needs --images N with N >= 1")
        questions = questions[:1]
    count = images if modality == "multi-image" else 1
    kind = MEDIA_KIND[modality]
    rendered = spec.chat is None or tokenizer is not None  # a chat is rendered by the tokenizer's template
    requests = []
    for question in questions:
        messages = spec.messages(question, count, kind) if spec.chat else None
        prompt = prompt_text(spec, tokenizer, question, count, kind) if rendered else None
        requests.append(PromptRequest(prompt=prompt, messages=messages))
    return RecipeRequests(
        recipe=recipe.name,
        model=recipe.model_for(modality, model),
        modality=modality,
        engine_args=recipe.engine_args_for(modality, images=images, model=model),
        requests=requests,
        stop_token_ids=resolve_stop_ids(tokenizer, recipe, modality),
        stop_tokens=recipe.stops_for(modality)[1],
        chat_template=spec.chat_template,
    )
