"""Google: Gemma 3, Gemma 3n, PaliGemma 1 and 2."""

from vlm_caption.recipes.base import Prompting, Recipe

# PaliGemma is prompted with task prefixes, not questions: the example always captions.
_PALIGEMMA = Recipe(name="paligemma", family="paligemma", model_types=("paligemma",),
                    model="google/paligemma-3b-mix-224", image=Prompting(template="caption en"),
                    notes="Task-prefix model: the question is replaced by 'caption en'.")

RECIPES = (
    Recipe(name="gemma3", family="gemma", model_types=("gemma3",), model="google/gemma-3-4b-it", max_model_len=2048,
           engine_args={"mm_processor_kwargs": {"do_pan_and_scan": True}},
           image=Prompting(template="<bos><start_of_turn>user\n{media}{question}<end_of_turn>\n"
                           "<start_of_turn>model\n", media="<start_of_image>"),
           multi_image=Prompting(chat="parts", engine_args={"max_model_len": 8192,
                                                            "mm_processor_kwargs": None})),
    Recipe(name="gemma3n", family="gemma", model_types=("gemma3n",), model="google/gemma-3n-E2B-it", max_model_len=2048,
           engine_args={"enforce_eager": True},
           image=Prompting(template="<start_of_turn>user\n{media}{question}<end_of_turn>\n"
                           "<start_of_turn>model\n", media="<image_soft_token>")),
    _PALIGEMMA,
    _PALIGEMMA.model_copy(update={"name": "paligemma2", "model": "google/paligemma2-3b-ft-docci-448"}),
)
