"""Every recipe proven through vLLM's own processor on a tiny checkpoint of its architecture (issue 26).

The rows the check makes here must be the ones committed in recipes/checks.json, which the recipes
page (docs/recipes.md) is generated from: a recipe that breaks, or one that gets fixed, fails this
test until the page says so.
"""

from __future__ import annotations

import pytest

from vlm_caption.recipes import all_recipes, get_recipe
from vlm_caption.recipes.table import load_checks
from tests.checkpoints import BUILDERS, RECIPE_CHECKPOINTS, build_checkpoint
from tests.recipe_check import check_processing, run_processing

REGENERATE = "uv run python -m tests.recipe_check processing --update  (then: uv run vlm-caption recipes list " \
             "--markdown > docs/recipes.md)"
TARGET_RECIPES_OK = 32 + 17  # 32 of the 36 recipes that need no remote code, 17 of the 26 that do (issue 39)


def test_every_recipe_without_remote_code_has_a_tiny_checkpoint_builder():
    missing = [r.name for r in all_recipes() if not r.needs_remote_code and r.name not in RECIPE_CHECKPOINTS]
    assert missing == []
    assert set(RECIPE_CHECKPOINTS.values()) <= set(BUILDERS)


def test_every_remote_code_recipe_is_checked_or_says_what_it_lacks():
    """Issue 39: no blanket "needs the model repository's code" on the recipes page. A remote-code
    recipe has a tiny checkpoint, is one vLLM no longer implements, or recipes/checks.json says
    exactly what its checkpoint would lack."""
    from tests.checkpoints import MODALITY_CHECKPOINTS

    unchecked = load_checks()["unchecked"]
    for recipe in all_recipes():
        if recipe.needs_remote_code and not recipe.removed_from_vllm:
            assert (recipe.name in RECIPE_CHECKPOINTS) != (recipe.name in unchecked), recipe.name
    assert set(MODALITY_CHECKPOINTS.values()) <= set(BUILDERS)


@pytest.fixture(scope="module")
def processing_rows(checkpoints_root):
    return run_processing(None, None, checkpoints_root)


def test_processing_checks_match_the_recipes_page(processing_rows):
    got = {(r.recipe, r.modality): (r.ok, r.error) for r in processing_rows}
    committed = {(r["recipe"], r["modality"]): (r["ok"], r["error"]) for r in load_checks()["processing"]}
    changed = {case: (committed.get(case), now) for case, now in got.items() if committed.get(case, (None,))[0] != now[0]}
    assert not changed, f"the processing check no longer matches recipes/checks.json; regenerate: {REGENERATE}\n{changed}"
    assert set(got) == set(committed)


def test_processing_check_passes_for_the_target_recipes(processing_rows):
    failing = {r.recipe for r in processing_rows if not r.ok}
    passing = {r.recipe for r in processing_rows} - failing
    assert len(passing) >= TARGET_RECIPES_OK, sorted(failing)


def test_recipes_vllm_no_longer_implements_are_marked_and_refused_up_front(processing_rows):
    """vLLM's refusal ("... is not supported anymore") once came as a traceback from the engine."""
    from vlm_caption.flows.params import CaptionJob

    gone = {r.recipe for r in processing_rows if "until v0." in r.error or "not supported anymore" in r.error}
    marked = {r.name for r in all_recipes() if r.removed_from_vllm}
    assert gone <= marked, gone - marked
    for name in sorted(marked):
        recipe = get_recipe(name)
        with pytest.raises(ValueError, match="cannot run on this vLLM"):
            CaptionJob(source="/tmp", output="/tmp/out", recipe=name, modality=recipe.modalities[0])


def test_a_prompt_without_its_placeholder_fails_the_check(monkeypatch, checkpoints_root):
    """The check is not a formality: vLLM refuses a prompt whose media placeholder is missing."""
    import vlm_caption.recipes as registry

    llava = get_recipe("llava")
    broken = llava.model_copy(update={"image": llava.image.model_copy(update={"media": ""})})
    monkeypatch.setattr(registry, "get_recipe", lambda name: broken)
    row = check_processing("llava", "image", build_checkpoint("llava", checkpoints_root), "llava")
    assert not row.ok
    assert "placeholder" in row.error.lower()


def test_a_prompt_the_engine_would_see_otherwise_fails_the_check(monkeypatch, checkpoints_root):
    """HunyuanOCR with its example's start and end tokens around the image token: the HF processor
    reads the text as one image, but vLLM's engine tokenizes first and its prompt update adds
    start and end again, two image starts for one image (the engine died on it on a GPU)."""
    import vlm_caption.recipes as registry

    hunyuan = get_recipe("hunyuan_vl")
    start, end = "<\uff5chy_place\u2581holder\u2581no\u2581100\uff5c>", "<\uff5chy_place\u2581holder\u2581no\u2581101\uff5c>"
    example = hunyuan.model_copy(update={"image": hunyuan.image.model_copy(
        update={"media": start + hunyuan.image.media + end})})
    monkeypatch.setattr(registry, "get_recipe", lambda name: example)
    row = check_processing("hunyuan_vl", "image", build_checkpoint("hunyuan_vl", checkpoints_root), "hunyuan_vl")
    assert not row.ok
    assert "the engine's tokenized prompt becomes" in row.error
    monkeypatch.setattr(registry, "get_recipe", lambda name: hunyuan)
    assert check_processing("hunyuan_vl", "image", build_checkpoint("hunyuan_vl", checkpoints_root), "hunyuan_vl").ok
