"""Idefics3 and SmolVLM (HuggingFaceM4 / HuggingFaceTB)."""

from vlm_caption.recipes.base import Prompting, Recipe

RECIPES = (
    Recipe(name="idefics3", family="idefics", model_types=("idefics3",), model="HuggingFaceM4/Idefics3-8B-Llama3", max_model_len=8192,
           # Lower longest_edge to save memory (model card: model optimizations).
           engine_args={"enforce_eager": True, "mm_processor_kwargs": {"size": {"longest_edge": 3 * 364}}},
           image=Prompting(template="<|begin_of_text|>User:{media}{question}<end_of_utterance>\nAssistant:",
                           media="<image>"),
           multi_image=Prompting(
               template="<|begin_of_text|>User:{media}\n{question}<end_of_utterance>\nAssistant:",
               media="Image-{i}: <image>\n", joiner="\n",
               engine_args={"mm_processor_kwargs": {"size": {"longest_edge": 2 * 364}}})),
    Recipe(name="smolvlm", family="idefics", model_types=("smolvlm", "idefics3"), model="HuggingFaceTB/SmolVLM2-2.2B-Instruct", max_model_len=8192,
           engine_args={"enforce_eager": True,
                        "mm_processor_kwargs": {"max_image_size": {"longest_edge": 384}}},
           image=Prompting(template="<|im_start|>User:{media}{question}<end_of_utterance>\nAssistant:",
                           media="<image>")),
)
