"""Zhipu GLM-4V, GLM-4.1V and GLM-4.5V."""

from vlm_caption.recipes.base import Prompting, Recipe

_GLM41 = ("[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>\n{media}{question}"
          "<|assistant|>assistant\n")
_GLM41_ARGS = {"enforce_eager": True, "mm_processor_kwargs": {
    "size": {"shortest_edge": 12544, "longest_edge": 47040000}, "fps": 1}}
_IMAGE = Prompting(template=_GLM41, media="<|begin_of_image|><|image|><|end_of_image|>")
_VIDEO = Prompting(template=_GLM41, media="<|begin_of_video|><|video|><|end_of_video|>")
_GLM45 = Recipe(name="glm4_5v", family="glm", model="zai-org/GLM-4.5V", max_model_len=4096,
                engine_args={**_GLM41_ARGS, "tensor_parallel_size": 4}, image=_IMAGE, video=_VIDEO,
                needs_video_metadata=True)

RECIPES = (
    Recipe(name="glm4v", family="glm", model="zai-org/glm-4v-9b", max_model_len=2048,
           engine_args={"trust_remote_code": True, "enforce_eager": True,
                        "hf_overrides": {"architectures": ["GLM4VForCausalLM"]}},
           image=Prompting(template="<|user|>\n{media}{question}<|assistant|>",
                           media="<|begin_of_image|><|endoftext|><|end_of_image|>"),
           stop_token_ids=(151329, 151336, 151338)),
    Recipe(name="glm4_1v", family="glm", model="zai-org/GLM-4.1V-9B-Thinking", max_model_len=4096,
           engine_args=_GLM41_ARGS, image=_IMAGE, video=_VIDEO, needs_video_metadata=True),
    _GLM45,
    _GLM45.model_copy(update={"name": "glm4_5v_fp8", "model": "zai-org/GLM-4.5V-FP8"}),
)
