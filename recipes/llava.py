"""LLaVA family: LLaVA-1.5, LLaVA-NeXT, LLaVA-NeXT-Video, LLaVA-OneVision, and LLaVA-style
derivatives that share its `<image>` placeholder (Mantis, Tarsier, R-4B)."""

from vlm_caption.recipes.base import Prompting, Recipe

_ONEVISION = "<|im_start|>user {media}\n{question}<|im_end|><|im_start|>assistant\n"

RECIPES = (
    Recipe(name="llava", family="llava", model_types=("llava",), aliases=("llava-1.5",),
           model="llava-hf/llava-1.5-7b-hf", max_model_len=4096,
           image=Prompting(template="USER: {media}\n{question}\nASSISTANT:", media="<image>"),
           # The multi-image example renders LLaVA-1.5 through its processor's chat template. The
           # model was not trained on several images; expect weak answers.
           multi_image=Prompting(chat="parts", engine_args={"max_model_len": None})),
    Recipe(name="llava-next", family="llava", model_types=("llava_next",), model="llava-hf/llava-v1.6-mistral-7b-hf",
           max_model_len=8192, image=Prompting(template="[INST] {media}\n{question} [/INST]", media="<image>")),
    Recipe(name="llava-next-video", family="llava", model_types=("llava_next_video",),
           model="llava-hf/LLaVA-NeXT-Video-7B-hf", max_model_len=8192,
           video=Prompting(template="USER: {media}\n{question} ASSISTANT:", media="<video>")),
    Recipe(name="llava-onevision", family="llava", model_types=("llava_onevision",),
           model="llava-hf/llava-onevision-qwen2-7b-ov-hf", max_model_len=16384,
           image=Prompting(template=_ONEVISION, media="<image>"), video=Prompting(template=_ONEVISION, media="<video>"),
           multi_image=Prompting(chat="parts")),
    # vLLM 0.26 dropped MantisForConditionalGeneration (supported until 0.24); the checkpoint is a
    # plain LLaVA one, so it loads as LlavaForConditionalGeneration, and the prompt carries the
    # "(image 1: <Image>...</Image>)" wrapping Mantis's own processor added.
    Recipe(name="mantis", family="llava", model="TIGER-Lab/Mantis-8B-siglip-llama3", max_model_len=4096,
           image=Prompting(template="<|start_header_id|>user<|end_header_id|>\n\n{question}\n{media}<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\n",
                           media="(image 1: <Image><image></Image>)"),
           stop_token_ids=(128009,)),
    Recipe(name="tarsier", family="llava", model="omni-research/Tarsier-7b", max_model_len=4096,
           engine_args={"trust_remote_code": True},
           image=Prompting(template="USER: {media}\n{question} ASSISTANT:", media="<image>"),
           removed_from_vllm="vLLM 0.26 no longer implements TarsierForConditionalGeneration (supported until "
                             "v0.24.0): use vLLM <= 0.24."),
    Recipe(name="rvl", family="llava", aliases=("r-4b",), model="YannQi/R-4B", max_model_len=16384,
           image=Prompting(template=_ONEVISION, media="<image>")),
)
