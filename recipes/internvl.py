"""InternVL-style models whose prompt is the model's own chat template over a text message
`"<image>\\n{question}"` (InternVL, H2OVL, NVLM-D, Nemotron-VL, Skywork-R1V, Intern-S1)."""

from vlm_caption.recipes.base import EOS_TOKEN, Prompting, Recipe

_TEXT = "{media}\n{question}"
_IMAGE = Prompting(chat="text", template=_TEXT, media="<image>")
_STOPS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|end|>")  # see InternVL2 conversation.py
_RC = {"trust_remote_code": True}


def _multi(**engine_args) -> Prompting:
    return Prompting(chat="text", template=_TEXT, media="Image-{i}: <image>\n", joiner="\n",
                     engine_args={"mm_processor_kwargs": {"max_dynamic_patch": 4}, **engine_args})


RECIPES = (
    Recipe(name="internvl_chat", family="internvl", model="OpenGVLab/InternVL3-2B", max_model_len=8192,
           engine_args=_RC, image=_IMAGE,
           video=Prompting(chat="text", template=_TEXT, media="<video>"),
           # The multi-image example uses InternVL2-2B.
           multi_image=_multi(max_model_len=4096).model_copy(update={"model": "OpenGVLab/InternVL2-2B"}),
           stop_tokens=_STOPS),
    Recipe(name="h2ovl_chat", family="internvl", model="h2oai/h2ovl-mississippi-800m", max_model_len=8192,
           engine_args=_RC, image=_IMAGE, multi_image=_multi(), stop_tokens=(EOS_TOKEN,)),
    Recipe(name="NVLM_D", family="internvl", model="nvidia/NVLM-D-72B", max_model_len=4096,
           engine_args={**_RC, "tensor_parallel_size": 4}, image=_IMAGE,
           multi_image=_multi(max_model_len=8192)),
    Recipe(name="nemotron_vl", family="internvl", model="nvidia/Llama-3.1-Nemotron-Nano-VL-8B-V1",
           max_model_len=8192, engine_args=_RC, image=_IMAGE, stop_tokens=_STOPS),
    Recipe(name="skywork_chat", family="internvl", model="Skywork/Skywork-R1V-38B", max_model_len=4096,
           engine_args=_RC, image=_IMAGE,
           stop_tokens=("<|end\u2581of\u2581sentence|>", "<|endoftext|>")),
    Recipe(name="interns1", family="internvl", model="internlm/Intern-S1-mini", max_model_len=8192,
           engine_args={**_RC, "enforce_eager": True},
           image=Prompting(chat="text", template=_TEXT, media="<IMG_CONTEXT>"),
           video=Prompting(chat="text", template=_TEXT, media="<video>")),
)
