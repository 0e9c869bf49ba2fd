"""The recipe registry: every model of vLLM's vision-language examples, by example name.

`get_recipe("llava")` returns a frozen `Recipe`; unknown names fail with close matches.
Each family module exposes `RECIPES`, a tuple of recipes; registering is listing it here.
"""

from __future__ import annotations

import difflib
from importlib import import_module

from vlm_caption.recipes.base import EOS_TOKEN, MODALITIES, LoraSpec, Modality, Prompting, Recipe, RecipeError

_FAMILY_MODULES = (
    "llava", "qwen", "internvl", "google", "glm", "phi", "mistral", "idefics", "minicpm", "ocr", "others",
)

__all__ = [
    "EOS_TOKEN", "MODALITIES", "LoraSpec", "Modality", "Prompting", "Recipe", "RecipeError",
    "all_recipes", "get_recipe",
]


def _load() -> tuple[dict[str, Recipe], dict[str, str]]:
    recipes: dict[str, Recipe] = {}
    aliases: dict[str, str] = {}
    for module in _FAMILY_MODULES:
        for recipe in import_module(f"recipes.{module}").RECIPES:
            if recipe.name in recipes:
                raise RuntimeError(f"recipe {recipe.name!r} is defined twice")
            recipes[recipe.name] = recipe
            for alias in recipe.aliases:
                aliases[alias] = recipe.name
    return recipes, aliases


_RECIPES, _ALIASES = _load()


def all_recipes() -> list[Recipe]:
    return sorted(_RECIPES.values(), key=lambda r: r.name.lower())


def get_recipe(name: str) -> Recipe:
    key = _ALIASES.get(name, name)
    if key in _RECIPES:
        return _RECIPES[key]
    close = difflib.get_close_matches(name, [*_RECIPES, *_ALIASES], n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise RecipeError(
        f"unknown recipe {name!r}.{hint} Run `vlm-caption recipes list` to see all recipes."
    )
