"""Mistral Small 3.1 and Pixtral (HF format)."""

from vlm_caption.recipes.base import Prompting, Recipe

_INST = "<s>[INST]{question}\n{media}[/INST]"

RECIPES = (
    Recipe(name="mistral3", family="mistral", model_types=("mistral3",), model="mistralai/Mistral-Small-3.1-24B-Instruct-2503",
           max_model_len=8192,
           engine_args={"tensor_parallel_size": 2, "ignore_patterns": ["consolidated.safetensors"]},
           image=Prompting(template=_INST, media="[IMG]")),
    Recipe(name="pixtral_hf", family="mistral", model="mistral-community/pixtral-12b", max_model_len=6144,
           image=Prompting(template=_INST, media="[IMG]"),
           multi_image=Prompting(template=_INST, media="[IMG]",
                                 engine_args={"max_model_len": 8192, "tensor_parallel_size": 2})),
)
