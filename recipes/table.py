"""docs/recipes.md: every recipe as a table, generated from the registry so it cannot drift.

    uv run vlm-caption recipes list --markdown > docs/recipes.md
"""

from __future__ import annotations

from recipes import all_recipes

REGENERATE = "uv run vlm-caption recipes list --markdown > docs/recipes.md"
COLUMNS = ("name", "family", "default model", "modalities", "needs remote code", "processor on GPU", "GPUs")


def recipe_row(recipe) -> tuple[str, ...]:
    from tasks.engine.processor import place_processor  # imports only recipes: no torch, no vLLM

    on_gpu = place_processor(recipe, "auto", gpu=True).device == "cuda"  # what `auto` picks on a GPU host
    return (f"`{recipe.name}`", recipe.family, f"`{recipe.model}`", ", ".join(recipe.modalities) or "-",
            "yes" if recipe.needs_remote_code else "-", "yes" if on_gpu else "-", str(recipe.gpus_needed))


def recipes_markdown() -> str:
    rows = [recipe_row(recipe) for recipe in all_recipes()]
    lines = [
        "# Recipes",
        "",
        f"<!-- Generated from recipes/; do not edit. Regenerate: {REGENERATE} -->",
        "",
        f"{len(rows)} recipes, one per model of vLLM's vision-language examples (`recipes/<family>.py`).",
        "`vlm-caption recipes show NAME --modality image --json` prints the prompt, engine arguments and stop",
        "tokens one builds, without loading a model.",
        "",
        "- **modalities**: what one item may be (`--modality`); multi-image is a group of images.",
        "- **needs remote code**: the model runs its repository's own Python code; give `--trust-remote-code`.",
        "- **processor on GPU**: with `--processor-device auto` (the default) on a GPU host, the model's",
        "  processor runs on the GPU (a fast torch processor, checked against the CPU by",
        "  `python -m tests.gpu_processor_check`); elsewhere on the CPU. `--processor-device cuda` tries the",
        "  GPU for another recipe.",
        "- **GPUs**: the recipe's tensor-parallel size; give its worker that many GPUs.",
        "",
        "The processing and engine checks of issue 26 will add a column each (whether a recipe's processor",
        "and engine were checked on a tiny checkpoint).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "| " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
