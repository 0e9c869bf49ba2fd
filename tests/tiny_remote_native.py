"""Tiny random-weight checkpoints for remote-code recipes whose model transformers 5 now has natively:
Aria (rhymes-ai/Aria: AriaConfig / AriaProcessor) and Intern-S1 (internlm/Intern-S1-mini: vLLM's
InternS1ForConditionalGeneration serves transformers' InternVL format, with transformers'
InternVLProcessor). The hub repos still carry their own code (hence the recipes'
`--trust-remote-code`), but these checkpoints need none: config, processor and weights come from
transformers' classes, at tiny widths.
"""

from __future__ import annotations

from pathlib import Path

from tests.tiny_remote_common import TEXT, chatml_template, done, finish, tokenizer


def _save(model, out: Path) -> None:
    import torch

    model.to(torch.bfloat16).eval().save_pretrained(out, max_shard_size="100GB")


# --- Aria -----------------------------------------------------------------------------------------
# Aria's tokens: ChatML, and the image as `<fim_prefix><|img|><fim_suffix>` (the examples' form).
ARIA_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fim_prefix>", "<fim_suffix>", "<|img|>",
                 "<|fim_prefix|>", "<|fim_suffix|>"]
# An Idefics3 (SigLIP) tower at Aria's 490-px base size, patch 14: 35x35 = 1225 patches, which the
# projector's cross-attention turns into 128 queries (Aria's own `projector_patch_to_query_dict`).
ARIA_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
                   image_size=980, patch_size=14, model_type="idefics3_vision")
ARIA_TEXT = dict(TEXT, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1, moe_intermediate_size=128)


def build_tiny_aria(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if done(out):
        return out
    import torch
    from transformers import (AriaConfig, AriaForConditionalGeneration, AriaImageProcessor, AriaProcessor,
                              AriaTextConfig, Idefics3VisionConfig)

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    fast, ids = tokenizer(out, ARIA_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>", chat_template=chatml_template(),
                          extra={"extra_special_tokens": {"image_token": "<|img|>"}})
    text = {k: v for k, v in ARIA_TEXT.items() if k not in ("torch_dtype", "hidden_act")}
    text["intermediate_size"] = ARIA_TEXT["moe_intermediate_size"]
    vision = Idefics3VisionConfig(**{k: v for k, v in ARIA_VISION.items() if k != "model_type"})
    config = AriaConfig(vision_config=vision, text_config=AriaTextConfig(**text, vocab_size=len(fast),
                                                                       eos_token_id=ids["<|im_end|>"],
                                                                       pad_token_id=ids["<|endoftext|>"]),
                        projector_patch_to_query_dict={1225: 128, 4900: 256}, image_token_index=ids["<|img|>"],
                        tie_word_embeddings=False)
    config.architectures = ["AriaForConditionalGeneration"]
    _save(AriaForConditionalGeneration(config), out)
    AriaProcessor(image_processor=AriaImageProcessor(max_image_size=980, min_image_size=490), tokenizer=fast,
                  size_conversion={490: 128, 980: 256}).save_pretrained(out)
    return finish(out)


# --- Intern-S1 ------------------------------------------------------------------------------------
# Intern-S1-mini: an InternViT tower, a Qwen3 LM; InternVLProcessor's tokens, read off the tokenizer.
INTERNS1_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                   "video_token": "<video>"}
INTERNS1_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *INTERNS1_TOKENS.values()]


def build_tiny_interns1(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if done(out):
        return out
    import torch
    from transformers import (GotOcr2ImageProcessor, InternVLConfig, InternVLForConditionalGeneration,
                              InternVLProcessor, InternVLVideoProcessor)

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    fast, ids = tokenizer(out, INTERNS1_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>",
                          chat_template=chatml_template(), extra={"extra_special_tokens": INTERNS1_TOKENS})
    text = {k: v for k, v in TEXT.items() if k not in ("torch_dtype",)}
    config = InternVLConfig(
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
                           image_size=[112, 112], patch_size=[14, 14], use_qk_norm=False, attention_bias=True),
        text_config=dict(text, model_type="qwen3", vocab_size=len(fast), eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        image_token_id=ids["<IMG_CONTEXT>"], image_seq_length=16, downsample_ratio=0.5, tie_word_embeddings=False)
    config.architectures = ["InternS1ForConditionalGeneration"]
    _save(InternVLForConditionalGeneration(config), out)
    # Intern-S1-mini's tiling: 448-px tiles (112 here), up to 12, with a thumbnail.
    size = {"height": 112, "width": 112}
    InternVLProcessor(image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=True, min_patches=1,
                                                            max_patches=12),
                      video_processor=InternVLVideoProcessor(size=size), tokenizer=fast, image_seq_length=16,
                      chat_template=fast.chat_template).save_pretrained(out)
    return finish(out)


# --- Bee-8B ---------------------------------------------------------------------------------------
# vLLM's bee.py is LLaVA-OneVision (its processor class, LlavaNextMultiModalProcessor, with the
# anyres_max_9 feature count) with a wider projector (pre_norm, linear_1 to 4x the LM width,
# linear_2). The hub repo's config and processor classes are its own code: here the config is ours
# (a LlavaOnevisionConfig subclass named for model_type bee, tests/tiny_remote_common.py) and the
# processor transformers' LlavaOnevisionProcessor, which counts features the way vLLM's Bee does.
def build_tiny_bee(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if done(out):
        return out
    import json

    from transformers import LlavaOnevisionForConditionalGeneration, Qwen3Config

    from tests.tiny_llava_family import _save, _start, onevision_config, save_onevision_processor
    from tests.tiny_remote_common import write_remote_config

    # LLaVA-OneVision's tiny build (tests/tiny_llava_family.py) with Bee's projector and a Qwen3 LM.
    _start(out, seed)
    fast, config = onevision_config(out, Qwen3Config)
    model = LlavaOnevisionForConditionalGeneration(config)
    _bee_projector(model, config)
    _save(model, out, hub_layout=True)
    save_onevision_processor(out, fast)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="bee", architectures=["BeeForConditionalGeneration"])
    write_remote_config(out, config, {}, base="llava_onevision", class_name="BeeConfig")
    return finish(out)


def _bee_projector(model, config) -> None:
    import torch.nn as nn

    vision, text = config.vision_config.hidden_size, config.text_config.hidden_size
    projector = model.model.multi_modal_projector
    projector.pre_norm = nn.LayerNorm(vision, eps=1e-6)
    projector.linear_1 = nn.Linear(vision, text * 4, bias=True)
    projector.linear_2 = nn.Linear(text * 4, text, bias=True)
