"""MiniCPM-V 2.6 and MiniCPM-o 2.6 (chat template; stop tokens differ by version)."""

from vlm_caption.recipes.base import Prompting, Recipe

_IMAGE = Prompting(chat="text", template="{media}\n{question}", media="(<image>./</image>)")
_VIDEO = Prompting(chat="text", template="{media}\n{question}", media="(<video>./</video>)")
_STOPS = ("<|im_end|>", "<|endoftext|>")  # 2.6 / o2.6

RECIPES = tuple(
    Recipe(name=name, family="minicpm", model=model, max_model_len=4096,
           engine_args={"trust_remote_code": True}, image=_IMAGE, video=_VIDEO, stop_tokens=_STOPS)
    for name, model in (("minicpmv", "openbmb/MiniCPM-V-2_6"), ("minicpmo", "openbmb/MiniCPM-o-2_6"))
)
