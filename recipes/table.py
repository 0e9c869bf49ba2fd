"""docs/recipes.md: every recipe as a table, generated from the registry so it cannot drift.

    uv run vlm-caption recipes list --markdown > docs/recipes.md
"""

from __future__ import annotations

import json
from pathlib import Path

from vlm_caption.recipes import all_recipes

REGENERATE = "uv run vlm-caption recipes list --markdown > docs/recipes.md"
COLUMNS = ("name", "family", "default model", "modalities", "needs remote code", "processor on GPU", "GPUs",
           "processing check", "engine check")
# What the recipe checks found (tests/recipe_check.py): rows per (recipe, modality), written by
# `python -m tests.recipe_check processing|engine --out ...` and kept current by tests/test_recipe_checks.py.
CHECKS_FILE = Path(__file__).with_name("checks.json")
REMOTE_CODE = "needs the model repository's code (`--trust-remote-code`)"


def load_checks() -> dict:
    """{"processing": [row, ...], "engine": [row, ...], "engine_run": {...}}; empty lists when absent."""
    data = json.loads(CHECKS_FILE.read_text()) if CHECKS_FILE.exists() else {}
    return {"processing": [], "engine": [], "engine_run": {}, "unchecked": {}, **data}


def check_cell(recipe, rows: list[dict], unchecked: dict[str, str], notes: list[str], other_rows: list[dict] = ()) -> str:
    """'image ok, video ok' from this recipe's rows; a failure's reason goes to the notes below.

    A recipe without rows says why: `unchecked` (recipes/checks.json) names what its tiny checkpoint
    lacks; one checked the other way only (a new builder, its GPU engine run still to come) says so."""
    if recipe.removed_from_vllm:
        return f"cannot run: {recipe.removed_from_vllm}"
    mine = {row["modality"]: row for row in rows if row["recipe"] == recipe.name}
    if not mine:
        if recipe.name in unchecked:
            return f"not run: {unchecked[recipe.name]}"
        if any(row["recipe"] == recipe.name for row in other_rows):
            return "not run yet"
        return REMOTE_CODE if recipe.needs_remote_code else "not run: no tiny checkpoint"
    cells = []
    for modality in recipe.modalities:
        row = mine.get(modality)
        if row is None:
            cells.append(f"{modality} not run")
        elif row["ok"]:
            cells.append(f"{modality} ok")
        else:
            notes.append(f"{recipe.name} {modality}: {row['error']}")
            cells.append(f"{modality} fails [{len(notes)}]")
    return ", ".join(cells)


def recipe_row(recipe, checks: dict, notes: list[str]) -> tuple[str, ...]:
    on_gpu = recipe.processor_on_gpu_host
    return (f"`{recipe.name}`", recipe.family, f"`{recipe.model}`", ", ".join(recipe.modalities) or "-",
            "yes" if recipe.needs_remote_code else "-", "yes" if on_gpu else "-", str(recipe.gpus_needed),
            check_cell(recipe, checks["processing"], checks["unchecked"], notes),
            check_cell(recipe, checks["engine"], checks["unchecked"], notes, checks["processing"]))


def recipes_markdown() -> str:
    checks, notes = load_checks(), []
    rows = [recipe_row(recipe, checks, notes) for recipe in all_recipes()]
    run = checks["engine_run"]
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
        "- **processing check**: vLLM's own multimodal processor applied to the prompt this recipe builds,",
        "  with an image, a group of two images or an 8-frame clip, on a random-weight tiny checkpoint of",
        "  the recipe's architecture (`tests/checkpoints.py`): ok when every item's placeholders expand",
        "  and the prompt tokenized first, as the engine takes it, becomes the same prompt as the text.",
        "  CI runs it for every case (`tests/test_recipe_checks.py`; by hand:",
        "  `uv run python -m tests.recipe_check processing [NAME ...]`).",
        "- **engine check**: the flow on a folder of media with a real vLLM engine on that checkpoint, the",
        "  recipe's engine arguments and stop tokens, 8 tokens out"
        + (f" ({run['device']}, vLLM {run['vllm']}, {run['date']}: `{run['command']}`)." if run else "."),
        "  Prompt texts of every recipe equal what vLLM's examples build (`tests/test_recipes.py`), but",
        "  HunyuanOCR's: its example's start and end tokens around the image token reach vLLM 0.26's engine",
        "  twice (the recipe sends the image token alone; see recipes/ocr.py).",
        "- Remote-code recipes are checked with `--trust-remote-code` on tiny checkpoints whose only Python is",
        "  our own minimal files, never the model repository's code: a config class, and where vLLM 0.26 takes the",
        "  processor from the checkpoint (Kimi-VL, Keye-VL, MiniCPM-V/o, Nemotron-VL) a processor, image processor or",
        "  tokenizer class written from what vLLM's model file reads of it (`tests/tiny_remote_*.py`), and where it",
        "  builds the vision tower from the checkpoint's code (Nemotron-VL's C-RADIO) a minimal ViT with the interface",
        "  it calls; elsewhere vLLM builds the processor itself or takes transformers 5's (Bee: LLaVA-OneVision's).",
        "  A row without a checkpoint says what one would lack (recipes/checks.json `unchecked`); \"not run yet\":",
        "  the GPU engine check is still to run.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "| " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if notes:
        lines += ["", "Why a check fails:", ""] + [f"{i}. {note}" for i, note in enumerate(notes, 1)]
    return "\n".join(lines) + "\n"
