"""Tiny random-weight checkpoints for the InternVL-style remote-code recipes: InternVL (internvl_chat),
H2OVL (h2ovl_chat), NVLM-D (NVLM_D) and Skywork-R1V (skywork_chat).

Their hub repos ship `InternVLChatConfig`-style config classes (model_type internvl_chat, h2ovl_chat,
NVLM_D, skywork_chat); vLLM 0.26 builds their processors itself (vllm/transformers_utils/processors/
internvl.py, h2ovl.py, nvlm_d.py) from config.json's values and the tokenizer, so the checkpoint needs
only a config class holding those values: ours (tests/tiny_remote_common.py). The vision tower is
InternViT (vLLM's intern_vit.py names), 112-px tiles of patch 14 (16 tokens a tile after the 0.5
pixel shuffle), the tiling settings the real models ship (dynamic tiles 1..12, thumbnail).
"""

from __future__ import annotations

from pathlib import Path

from tests.tiny_remote_common import (TEXT, chatml_template, done, finish, layernorm, linear, llama_lm_shapes,
                                      save_random, text_config, tokenizer, write_remote_config)

TILE, PATCH = 112, 14
# InternViT-300M's kind (InternVL3, H2OVL): LayerNorm, q/k/v bias; InternViT-6B's (NVLM-D, Skywork-R1V):
# RMSNorm, q/k norms, no bias. One head of 64 (vLLM's CPU attention takes head_dim 64).
VIT_300M = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
                image_size=TILE, patch_size=PATCH, num_channels=3, qkv_bias=True, qk_normalization=False,
                norm_type="layer_norm", layer_norm_eps=1e-6, hidden_act="gelu", initializer_factor=1.0,
                drop_path_rate=0.0, dropout=0.0, attention_dropout=0.0, use_flash_attn=False,
                architectures=["InternVisionModel"], model_type="intern_vit_6b")
VIT_6B = dict(VIT_300M, qkv_bias=False, qk_normalization=True, norm_type="rms_norm")
# The InternVLChatConfig fields vLLM reads (InternVL3-2B's values; select_layer -1, pixel shuffle v2).
TILING = dict(select_layer=-1, ps_version="v2", downsample_ratio=0.5, force_image_size=TILE,
              dynamic_image_size=True, use_thumbnail=True, min_dynamic_patch=1, max_dynamic_patch=12,
              torch_dtype="bfloat16", use_backbone_lora=0, use_llm_lora=0)
INTERNVL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<quad>",
                     "</quad>", "<ref>", "</ref>", "<box>", "</box>", "<|video_pad|>"]


def _vit_shapes(shapes: dict, vision: dict, prefix: str = "vision_model.", dummy_heads: int = 0) -> None:
    """InternViT as the hub stores it (vLLM's intern_vit.py loads the same names); `dummy_heads`: the
    zero heads NVLM-D's checkpoint pads attention with (vLLM builds 7 more than the config says)."""
    d, inter = vision["hidden_size"], vision["intermediate_size"]
    inner = d + dummy_heads * (d // vision["num_attention_heads"])
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    emb = prefix + "embeddings."
    shapes[emb + "class_embedding"] = (1, 1, d)
    shapes[emb + "patch_embedding.weight"] = (d, 3, vision["patch_size"], vision["patch_size"])
    shapes[emb + "patch_embedding.bias"] = (d,)
    shapes[emb + "position_embedding"] = (1, patches + 1, d)
    norm_bias = vision["norm_type"] == "layer_norm"
    for i in range(vision["num_hidden_layers"]):
        layer = f"{prefix}encoder.layers.{i}."
        linear(shapes, layer + "attn.qkv", 3 * inner, d, bias=vision["qkv_bias"])
        if vision["qk_normalization"]:
            layernorm(shapes, layer + "attn.q_norm", inner, bias=False)
            layernorm(shapes, layer + "attn.k_norm", inner, bias=False)
        linear(shapes, layer + "attn.proj", d, inner, bias=True)
        linear(shapes, layer + "mlp.fc1", inter, d, bias=True)
        linear(shapes, layer + "mlp.fc2", d, inter, bias=True)
        layernorm(shapes, layer + "norm1", d, bias=norm_bias)
        layernorm(shapes, layer + "norm2", d, bias=norm_bias)
        shapes[layer + "ls1"] = shapes[layer + "ls2"] = (d,)


def _mlp1_shapes(shapes: dict, vision: dict, hidden: int, middle: int | None = None, bias: bool = True) -> None:
    """The projector: LayerNorm over 4 merged patches, Linear, GELU, Linear (`mlp1.0/1/3`)."""
    merged = vision["hidden_size"] * 4
    layernorm(shapes, "mlp1.0", merged)
    linear(shapes, "mlp1.1", middle or hidden, merged, bias=bias)
    linear(shapes, "mlp1.3", hidden, middle or hidden, bias=bias)


def _build(out: Path, seed: int, *, model_type: str, architecture: str, vision: dict, specials: list[str],
           eos: str, chat_template: str, lm: str = "qwen2", extra: dict | None = None,
           projector_middle: int | None = None, projector_bias: bool = True, dummy_heads: int = 0) -> Path:
    out = Path(out)
    if done(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    fast, ids = tokenizer(out, specials, eos=eos, pad=specials[0], chat_template=chat_template)
    arch = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[lm]
    llm = text_config(fast, ids, lm, arch, eos=eos)
    write_remote_config(out, dict(model_type=model_type, architectures=[architecture], vision_config=vision,
                                  llm_config=llm, **TILING, **(extra or {})),
                        {"vision_config": None, "llm_config": lm})
    shapes: dict = {}
    _vit_shapes(shapes, vision, dummy_heads=dummy_heads)
    _mlp1_shapes(shapes, vision, TEXT["hidden_size"], projector_middle, projector_bias)
    llama_lm_shapes(shapes, "language_model.", len(fast), qkv_bias=lm == "qwen2")
    save_random(out, shapes, seed)
    return finish(out)


def build_tiny_internvl_chat(out: Path, seed: int = 0) -> Path:
    """InternVL3-2B's kind: InternViT-300M, Qwen2 LM, ChatML; video frames as `<|video_pad|>` contexts."""
    return _build(out, seed, model_type="internvl_chat", architecture="InternVLChatModel", vision=VIT_300M,
                  specials=INTERNVL_SPECIALS, eos="<|im_end|>", chat_template=chatml_template(),
                  extra=dict(template="internvl2_5"))


# h2ovl-mississippi-800m: InternViT-300M, a Llama-architecture LM (H2O-Danube), its
# `<|prompt|>...<|end|><|answer|>` turns, and multi-scale adaptive cropping (use_msac) on.
H2OVL_SPECIALS = ["<unk>", "<s>", "</s>", "<|prompt|>", "<|answer|>", "<|system|>", "<|end|>", "<img>", "</img>",
                  "<IMG_CONTEXT>"]
H2OVL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}<|prompt|>"
    "{% elif message['role'] == 'system' %}<|system|>{% else %}<|answer|>{% endif %}{{ message['content'] }}"
    "<|end|>{% endfor %}{% if add_generation_prompt %}<|answer|>{% endif %}")


def build_tiny_h2ovl_chat(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if done(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    fast, ids = tokenizer(out, H2OVL_SPECIALS, bos="<s>", eos="</s>", pad="<unk>", chat_template=H2OVL_CHAT_TEMPLATE)
    llm = text_config(fast, ids, "llama", "LlamaForCausalLM", eos="</s>", bos="<s>")
    write_remote_config(out, dict(model_type="h2ovl_chat", architectures=["H2OVLChatModel"], vision_config=VIT_300M,
                                  llm_config=llm, **TILING, use_msac=True, template="h2ogpt2"),
                        {"vision_config": None, "llm_config": "llama"})
    shapes: dict = {}
    _vit_shapes(shapes, VIT_300M)
    _mlp1_shapes(shapes, VIT_300M, TEXT["hidden_size"])
    llama_lm_shapes(shapes, "language_model.", len(fast))
    save_random(out, shapes, seed)
    return finish(out)


# NVLM-D-72B: InternViT-6B, Qwen2 LM, `<Image><tile_1>...<tile_global_thumbnail>...</Image>` with
# `<|vision_pad|>` contexts; its projector goes through the LM's intermediate width, without bias.
NVLM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<Image>", "</Image>", "<|vision_pad|>",
                 "<tile_global_thumbnail>", *[f"<tile_{i}>" for i in range(1, 13)]]


def build_tiny_nvlm_d(out: Path, seed: int = 0) -> Path:
    return _build(out, seed, model_type="NVLM_D", architecture="NVLM_D", vision=VIT_6B, specials=NVLM_SPECIALS,
                  eos="<|im_end|>", chat_template=chatml_template(),
                  projector_middle=TEXT["intermediate_size"], projector_bias=False, dummy_heads=7)


# Skywork-R1V-38B: InternViT-6B, a Qwen2 LM (DeepSeek-R1-distilled), InternVL's image tokens.
SKYWORK_SPECIALS = ["<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<img>",
                    "</img>", "<IMG_CONTEXT>", "<think>", "</think>"]
SKYWORK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<｜Assistant｜>{{ message['content'] }}<｜end▁of▁sentence｜>"
    "{% else %}{{ message['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n"
    "{% endif %}")


def build_tiny_skywork_chat(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if done(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    fast, ids = tokenizer(out, SKYWORK_SPECIALS, bos=bos, eos=eos, pad=eos, chat_template=SKYWORK_CHAT_TEMPLATE)
    llm = text_config(fast, ids, "qwen2", "Qwen2ForCausalLM", eos=eos, bos=bos)
    write_remote_config(out, dict(model_type="skywork_chat", architectures=["SkyworkR1VChatModel"],
                                  vision_config=VIT_6B, llm_config=llm, **TILING, template="skywork-r1v"),
                        {"vision_config": None, "llm_config": "qwen2"})
    shapes: dict = {}
    _vit_shapes(shapes, VIT_6B)
    _mlp1_shapes(shapes, VIT_6B, TEXT["hidden_size"])
    llama_lm_shapes(shapes, "language_model.", len(fast), qkv_bias=True)
    save_random(out, shapes, seed)
    return finish(out)


def build_tiny_internvl2_chat(out: Path, seed: int = 0) -> Path:
    """InternVL2-2B's kind, for internvl_chat's multi-image example: as InternVL3, but its tokenizer has no
    video context token (vLLM maps one only for Qwen2/Qwen3 LMs; InternVL2-2B's is InternLM2), so vLLM
    builds no video processor -- which would reject the example's `max_dynamic_patch` (vLLM 0.26 hands
    `mm_processor_kwargs` to InternVLVideoProcessor too). A Qwen2 LM stands in for InternLM2, whose
    config class exists only in the hub repo."""
    return _build(out, seed, model_type="internvl_chat", architecture="InternVLChatModel", vision=VIT_300M,
                  specials=[t for t in INTERNVL_SPECIALS if t != "<|video_pad|>"], eos="<|im_end|>",
                  chat_template=chatml_template(), extra=dict(template="internlm2-chat"))
