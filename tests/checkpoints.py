"""Tiny random-weight checkpoints for tests: one builder per architecture, one table.

`build_checkpoint("llava", folder)` writes a checkpoint real vLLM can load. Builders are named
`module:function` and imported only when used (each family's module imports its own transformers
classes); they are idempotent per folder, so suites and checks in one session share the files.
Adding a model: one builder entry below, one line in RECIPE_CHECKPOINTS.
"""

from __future__ import annotations

import importlib
from pathlib import Path

# architecture -> "module:function(out: Path) -> Path"
BUILDERS: dict[str, str] = {
    # LLaVA and the models built like it (tests/tiny_llava_family.py)
    "llava": "vlm_caption.tasks.tiny_checkpoint:build_tiny_llava",
    "llava_next": "tests.tiny_llava_next:build_tiny_llava_next",
    "llava_next_video": "tests.tiny_llava_family:build_tiny_llava_next_video",
    "llava_onevision": "tests.tiny_llava_family:build_tiny_llava_onevision",
    "mantis": "tests.tiny_llava_family:build_tiny_mantis",
    "pixtral_hf": "tests.tiny_llava_family:build_tiny_pixtral_hf",
    "mistral3": "tests.tiny_llava_family:build_tiny_mistral3",
    "lightonocr": "tests.tiny_llava_family:build_tiny_lightonocr",
    "aya_vision": "tests.tiny_llava_family:build_tiny_aya_vision",
    "cohere2_vision": "tests.tiny_llava_family:build_tiny_cohere2_vision",
    "rvl": "tests.tiny_llava_family:build_tiny_rvl",
    # Qwen-VL and GLM-V (tests/tiny_qwen_family.py)
    "qwen2_vl": "vlm_caption.bench.checkpoints:build_tiny_qwen2_vl",
    "qwen2_5_vl": "vlm_caption.bench.checkpoints:build_tiny_qwen2_5_vl",
    "qwen3_vl": "tests.tiny_qwen_family:build_tiny_qwen3_vl",
    "qwen3_vl_moe": "tests.tiny_qwen_family:build_tiny_qwen3_vl_moe",
    "qwen2_5_omni": "tests.tiny_qwen_family:build_tiny_qwen2_5_omni",
    "tarsier2": "tests.tiny_qwen_family:build_tiny_tarsier2",
    "glm4v": "tests.tiny_qwen_family:build_tiny_glm4v",
    "glm4v_moe": "tests.tiny_qwen_family:build_tiny_glm4v_moe",
    "glm4v_moe_fp8": "tests.tiny_qwen_family:build_tiny_glm4v_moe_fp8",
    # Google, Meta, Hugging Face and early VLMs (tests/tiny_misc_family.py)
    "paligemma": "tests.tiny_paligemma:build_tiny_paligemma",
    "paligemma2": "tests.tiny_misc_family:build_tiny_paligemma2",
    "gemma3": "tests.tiny_gemma3:build_tiny_gemma3",
    "gemma3n": "tests.tiny_misc_family:build_tiny_gemma3n",
    "idefics3": "tests.tiny_idefics3:build_tiny_idefics3",
    "smolvlm": "tests.tiny_misc_family:build_tiny_smolvlm",
    "llama4": "tests.tiny_misc_family:build_tiny_llama4",
    "mllama": "tests.tiny_misc_family:build_tiny_mllama",
    "blip2": "tests.tiny_misc_family:build_tiny_blip2",
    "chameleon": "tests.tiny_misc_family:build_tiny_chameleon",
    "fuyu": "tests.tiny_misc_family:build_tiny_fuyu",
    # Models whose config and processor live in vLLM itself (tests/tiny_vllm_family.py)
    "deepseek_ocr": "tests.tiny_vllm_family:build_tiny_deepseek_ocr",
    "deepseek_vl_v2": "tests.tiny_vllm_family:build_tiny_deepseek_vl_v2",
    "step3": "tests.tiny_vllm_family:build_tiny_step3",
    "hunyuan_vl": "tests.tiny_vllm_family:build_tiny_hunyuan_vl",
    "phi4_multimodal": "tests.tiny_vllm_family:build_tiny_phi4_multimodal",
    # Remote-code models: vLLM's own processor, our minimal config class (tests/tiny_remote_*.py)
    "internvl_chat": "tests.tiny_remote_internvl:build_tiny_internvl_chat",
    "h2ovl_chat": "tests.tiny_remote_internvl:build_tiny_h2ovl_chat",
    "nvlm_d": "tests.tiny_remote_internvl:build_tiny_nvlm_d",
    "skywork_chat": "tests.tiny_remote_internvl:build_tiny_skywork_chat",
    "internvl2_chat": "tests.tiny_remote_internvl:build_tiny_internvl2_chat",
    "aria": "tests.tiny_remote_native:build_tiny_aria",
    "interns1": "tests.tiny_remote_native:build_tiny_interns1",
    "dots_ocr": "tests.tiny_remote_vllm:build_tiny_dots_ocr",
    "glm4v_chatglm": "tests.tiny_remote_vllm:build_tiny_glm4v_chatglm",
    "ovis": "tests.tiny_remote_vllm:build_tiny_ovis",
    "ovis2_5": "tests.tiny_remote_vllm:build_tiny_ovis2_5",
    "bee": "tests.tiny_remote_native:build_tiny_bee",
    "kimi_vl": "tests.tiny_remote_kimi:build_tiny_kimi_vl",
    "keye_vl": "tests.tiny_remote_keye:build_tiny_keye_vl",
    "keye_vl1_5": "tests.tiny_remote_keye:build_tiny_keye_vl1_5",
    "minicpmv": "tests.tiny_remote_minicpm:build_tiny_minicpmv",
    "minicpmo": "tests.tiny_remote_minicpm:build_tiny_minicpmo",
    "nemotron_vl": "tests.tiny_remote_nemotron:build_tiny_nemotron_vl",
}

# recipe -> the architecture whose tiny checkpoint its checks run on
RECIPE_CHECKPOINTS: dict[str, str] = {
    "aya_vision": "aya_vision", "blip-2": "blip2", "chameleon": "chameleon", "command_a_vision": "cohere2_vision",
    "deepseek_ocr": "deepseek_ocr", "deepseek_vl_v2": "deepseek_vl_v2", "fuyu": "fuyu", "gemma3": "gemma3",
    "gemma3n": "gemma3n", "glm4_1v": "glm4v", "glm4_5v": "glm4v_moe", "glm4_5v_fp8": "glm4v_moe_fp8",
    "hunyuan_vl": "hunyuan_vl", "idefics3": "idefics3", "lightonocr": "lightonocr", "llama4": "llama4",
    "llava": "llava", "llava-next": "llava_next", "llava-next-video": "llava_next_video",
    "llava-onevision": "llava_onevision", "mantis": "mantis", "mistral3": "mistral3", "mllama": "mllama",
    "paligemma": "paligemma", "paligemma2": "paligemma2", "phi4_multimodal": "phi4_multimodal",
    "pixtral_hf": "pixtral_hf", "qwen2_5_omni": "qwen2_5_omni", "qwen2_5_vl": "qwen2_5_vl",
    "qwen2_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl_moe", "rvl": "rvl",
    "smolvlm": "smolvlm", "step3": "step3", "tarsier2": "tarsier2",
    # remote-code recipes (tests/tiny_remote_*.py)
    "internvl_chat": "internvl_chat", "h2ovl_chat": "h2ovl_chat", "NVLM_D": "nvlm_d", "skywork_chat": "skywork_chat",
    "aria": "aria", "interns1": "interns1", "dots_ocr": "dots_ocr", "glm4v": "glm4v_chatglm",
    "ovis": "ovis", "ovis2_5": "ovis2_5", "bee": "bee", "kimi_vl": "kimi_vl", "keye_vl": "keye_vl", "keye_vl1_5": "keye_vl1_5",
    "minicpmv": "minicpmv", "minicpmo": "minicpmo", "nemotron_vl": "nemotron_vl",
}

# (recipe, modality) -> architecture, where a modality's recipe names another model than the recipe's
# default (internvl_chat's multi-image example runs InternVL2-2B, whose LM has no video token).
MODALITY_CHECKPOINTS: dict[tuple[str, str], str] = {("internvl_chat", "multi-image"): "internvl2_chat"}


def checkpoint_architecture(recipe: str, modality: str) -> str:
    return MODALITY_CHECKPOINTS.get((recipe, modality), RECIPE_CHECKPOINTS[recipe])


def builder(architecture: str):
    module, function = BUILDERS[architecture].split(":")
    return getattr(importlib.import_module(module), function)


def build_checkpoint(architecture: str, root: Path) -> Path:
    return builder(architecture)(Path(root) / architecture)
