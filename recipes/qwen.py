"""Qwen-VL family and models built on its `<|vision_start|>...<|vision_end|>` format
(Qwen-VL, Qwen2/2.5/3-VL, Qwen2.5-Omni, Tarsier2, Keye-VL)."""

from vlm_caption.recipes.base import Prompting, Recipe

_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
_VISION = (_SYSTEM + "<|im_start|>user\n<|vision_start|>{media}<|vision_end|>{question}<|im_end|>\n"
           "<|im_start|>assistant\n")
_IMAGE = Prompting(template=_VISION, media="<|image_pad|>")
_VIDEO = Prompting(template=_VISION, media="<|video_pad|>")
_PIXELS = {"min_pixels": 28 * 28, "max_pixels": 1280 * 28 * 28}
# The multi-image example renders Qwen2/2.5-VL through the processor's chat template, with a
# system message and one image part per picture, and no pixel limits.
_MULTI = Prompting(chat="parts", system="You are a helpful assistant.",
                   engine_args={"max_model_len": 32768, "mm_processor_kwargs": None})
_KEYE = ("<|im_start|>user\n<|vision_start|>{media}<|vision_end|>{question}<|im_end|>\n"
         "<|im_start|>assistant\n")
_OMNI = ("<|im_start|>system\nYou are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable "
         "of perceiving auditory and visual inputs, as well as generating text and speech.<|im_end|>\n"
         "<|im_start|>user\n<|vision_bos|>{media}<|vision_eos|>{question}<|im_end|>\n<|im_start|>assistant\n")
_CHATML = ("{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
           "{% endif %}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
           "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}")
_QWEN3 = Recipe(name="qwen3_vl", family="qwen", model_types=("qwen3_vl",), model="Qwen/Qwen3-VL-4B-Instruct",
                max_model_len=4096, engine_args={"mm_processor_kwargs": {**_PIXELS, "fps": 1}},
                image=_IMAGE, video=_VIDEO, needs_video_metadata=True)
_KEYE_VL = Recipe(name="keye_vl", family="qwen", model="Kwai-Keye/Keye-VL-8B-Preview", max_model_len=8192,
                  engine_args={"trust_remote_code": True}, image=Prompting(template=_KEYE, media="<|image_pad|>"),
                  video=Prompting(template=_KEYE, media="<|video_pad|>"))
_QWEN_VL_ARGS = {"trust_remote_code": True,
                 "hf_overrides": {"architectures": ["QwenVLForConditionalGeneration"]}}
# vLLM's registry (_PREVIOUSLY_SUPPORTED_MODELS): both Qwen-VL architectures went in 0.24.
_QWEN_VL_GONE = ("vLLM 0.26 no longer implements QwenVLForConditionalGeneration (nor QWenLMHeadModel; supported "
                 "until v0.23.0): use vLLM <= 0.23.")

RECIPES = (
    Recipe(name="qwen_vl", family="qwen", model="Qwen/Qwen-VL", max_model_len=1024,
           engine_args=_QWEN_VL_ARGS,
           image=Prompting(template="{question}{media}", media="Picture 1: <img></img>\n"),
           removed_from_vllm=_QWEN_VL_GONE),
    Recipe(name="qwen_vl_chat", family="qwen", model="Qwen/Qwen-VL-Chat", max_model_len=1024,
           engine_args=_QWEN_VL_ARGS,
           # The tokenizer has no chat template; the model's generation code uses ChatML.
           multi_image=Prompting(chat="text", template="{media}\n{question}",
                                 media="Picture {i}: <img></img>\n", chat_template=_CHATML),
           stop_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
           removed_from_vllm=_QWEN_VL_GONE),
    Recipe(name="qwen2_vl", family="qwen", model_types=("qwen2_vl",), processor_on_gpu=True, model="Qwen/Qwen2-VL-7B-Instruct", max_model_len=4096,
           engine_args={"mm_processor_kwargs": _PIXELS},
           image=_IMAGE, video=_VIDEO, multi_image=_MULTI),
    Recipe(name="qwen2_5_vl", family="qwen", model_types=("qwen2_5_vl",), processor_on_gpu=True, model="Qwen/Qwen2.5-VL-3B-Instruct", max_model_len=4096,
           engine_args={"mm_processor_kwargs": {**_PIXELS, "fps": 1}},
           image=_IMAGE, video=_VIDEO, multi_image=_MULTI),
    Recipe(name="qwen2_5_omni", family="qwen", model_types=("qwen2_5_omni",), model="Qwen/Qwen2.5-Omni-7B", max_model_len=4096,
           # A scalar: transformers 5 validates `fps` as int/float (vLLM's example still has `[1]`).
           engine_args={"mm_processor_kwargs": {**_PIXELS, "fps": 1}},
           image=Prompting(template=_OMNI, media="<|IMAGE|>"), video=Prompting(template=_OMNI, media="<|VIDEO|>")),
    _QWEN3,
    _QWEN3.model_copy(update={"name": "qwen3_vl_moe", "model_types": ("qwen3_vl_moe",),
                              "model": "Qwen/Qwen3-VL-30B-A3B-Instruct"}),
    Recipe(name="tarsier2", family="qwen", model="omni-research/Tarsier2-Recap-7b", max_model_len=4096,
           engine_args={"hf_overrides": {"architectures": ["Tarsier2ForConditionalGeneration"]}},
           image=_IMAGE, video=_VIDEO,
           removed_from_vllm="vLLM 0.26 no longer implements Tarsier2ForConditionalGeneration (supported until "
                             "v0.23.0): use vLLM <= 0.23."),
    _KEYE_VL,
    _KEYE_VL.model_copy(update={"name": "keye_vl1_5", "model": "Kwai-Keye/Keye-VL-1.5-8B"}),
)
