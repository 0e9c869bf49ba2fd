"""Check the job's model before any engine starts: that it can be loaded (a complete local
folder, a hub id that is in the cache or that the hub will serve, room in the cache for its
download) and that it is the kind of model the recipe is for. A mistake is one `ModelError`
that says what to do, in about a second, instead of an engine start that ends in tracebacks.
The entry points are here; a checkpoint's files are read in `model_files.py`, the hub and its
cache asked in `model_hub.py` (a model fully in the cache is checked without the network; a
good answer of the hub is remembered for the process, so the CLI's check and the flow's cost one call).
"""

from __future__ import annotations

from pathlib import Path
from vlm_caption.recipes import Recipe, all_recipes
from vlm_caption.tasks.engine.model_files import SKIP_HINT, ModelError, ModelFound, check_folder, looks_local
from vlm_caption.tasks.engine.model_hub import hub_cache_dir, hub_endpoint, hub_offline, resolve_hub, token_key

__all__ = ["ModelError", "ModelFound", "check_model", "check_fits", "resolve_model"]


def check_model(recipe: Recipe, modality: str = "image", model: str | None = None, *,
                revision: str | None = None) -> ModelFound:
    """Resolve `model` (default: the recipe's for `modality`) and check it fits `recipe`;
    raise ModelError saying what is wrong and what to do."""
    name = recipe.model_for(modality, model)
    found = resolve_model(name, revision=revision, suggest=recipe.model)
    check_fits(found, recipe)
    return found


def resolve_model(name: str, *, revision: str | None = None, suggest: str | None = None) -> ModelFound:
    """A local folder, or a hub id found in the cache or on the hub. A URI (s3://..., which vLLM
    streams) and a single GGUF file are vLLM's to open: not checked here."""
    if "://" in name:
        return ModelFound(name, "uri")
    if name.endswith(".gguf") and Path(name).expanduser().is_file():
        return ModelFound(name, "file", str(Path(name).expanduser()))
    if looks_local(name):
        return check_folder(Path(name).expanduser(), name)
    return resolve_hub(name, revision, suggest, hub_cache_dir(), hub_endpoint(), hub_offline(), token_key())


def check_fits(found: ModelFound, recipe: Recipe) -> None:
    """The checkpoint's `model_type` is one the recipe is for (recipes that declare none, and
    checkpoints that state none, are not checked)."""
    if not recipe.model_types or not found.model_type or found.model_type in recipe.model_types:
        return
    kind = found.model_type
    arch = f" ({', '.join(found.architectures)})" if found.architectures else ""
    others = [r.name for r in all_recipes() if kind in r.model_types]
    wanted = " or ".join(repr(t) for t in recipe.model_types)
    if others:
        fix = f"Use --recipe {' or --recipe '.join(others)}"
    else:
        fix = "No recipe is for this model type (`vlm-caption recipes list` shows them); pick another model"
    raise ModelError(
        f"model {found.model} is a {kind!r} model{arch}, but recipe {recipe.name!r} is for {wanted} models "
        f"(its prompts would not match the model's). {fix}, or pass {SKIP_HINT} if this model really "
        f"takes the prompts of recipe {recipe.name!r}.")
