"""Microsoft Phi-3.5-vision and Phi-4-multimodal (with its vision LoRA)."""

from vlm_caption.recipes.base import LoraSpec, Prompting, Recipe

_PHI3 = "<|user|>\n{media}\n{question}<|end|>\n<|assistant|>\n"
_PHI4 = "<|user|>{media}{question}<|end|><|assistant|>"
# The vision LoRA ships inside the model repository next to the base weights.
_VISION_LORA = LoraSpec(name="vision", subdir="vision-lora", max_lora_rank=320)

RECIPES = (
    Recipe(name="phi3_v", family="phi", model="microsoft/Phi-3.5-vision-instruct", max_model_len=4096,
           # num_crops: 16 for single images, 4 for several (the model card's advice).
           engine_args={"trust_remote_code": True, "mm_processor_kwargs": {"num_crops": 16}},
           image=Prompting(template=_PHI3, media="<|image_{i}|>"),
           multi_image=Prompting(template=_PHI3, media="<|image_{i}|>", joiner="\n",
                                 engine_args={"mm_processor_kwargs": {"num_crops": 4}})),
    Recipe(name="phi4_mm", family="phi", model="microsoft/Phi-4-multimodal-instruct", max_model_len=5120,
           engine_args={"trust_remote_code": True, "mm_processor_kwargs": {"dynamic_hd": 16}},
           image=Prompting(template=_PHI4, media="<|image_{i}|>"),
           multi_image=Prompting(template=_PHI4, media="<|image_{i}|>",
                                 engine_args={"max_model_len": 10000, "mm_processor_kwargs": None}),
           lora=_VISION_LORA),
    Recipe(name="phi4_multimodal", family="phi", model="microsoft/Phi-4-multimodal-instruct",
           max_model_len=5120,
           # The HF-format weights live on the repository's PR #70 revision.
           engine_args={"revision": "refs/pr/70", "mm_processor_kwargs": {"dynamic_hd": 16}},
           image=Prompting(template=_PHI4, media="<|image|>"), lora=_VISION_LORA,
           removed_from_vllm="vLLM 0.26 no longer implements the transformers-format Phi4MultimodalForCausalLM "
                             "(supported until v0.12.0): use the phi4_mm recipe (the original format)."),
)
