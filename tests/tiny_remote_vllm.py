"""Tiny random-weight checkpoints for remote-code recipes whose config class vLLM 0.26 ships itself
(vllm/transformers_utils/configs/): GLM-4V (ChatGLMConfig, vLLM's GLM4VProcessor) and Ovis2 (OvisConfig, vLLM's OvisProcessor).

vLLM registers these config classes for their model_type, so config.json alone (in the hub's form)
is enough; `--trust-remote-code` stays on as the recipes have it, but nothing remote is loaded.
And dots.ocr: vLLM 0.26 has DotsOCRConfig and builds transformers' Qwen2VLProcessor, but does not
register the config for model_type dots_ocr, so the checkpoint carries our minimal config class.
Weights are written from (name, shape) tables in the hub's names (what vLLM's `load_weights` and
`hf_to_vllm_mapper` read).
"""

from __future__ import annotations

from pathlib import Path

from tests.tiny_remote_common import (TEXT, done, finish, layernorm, linear, llama_lm_shapes, save_random,
                                      siglip_tower_shapes,
                                      tokenizer, write_json, write_remote_config)

# --- dots.ocr -------------------------------------------------------------------------------------
DOTS_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|img|>", "<|imgpad|>", "<|endofimg|>",
                 "<|video_pad|>", "<|user|>", "<|assistant|>"]
# dots.ocr's vision tower (NaViT, patch 14, 2x2 merge, no temporal patch) at tiny width.
DOTS_VISION = dict(embed_dim=64, hidden_size=TEXT["hidden_size"], intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=1, num_channels=3, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=1, rms_norm_eps=1e-5, use_bias=False, post_norm=True,
                   attn_implementation="sdpa")
# dots.ocr's preprocessor_config.json (Qwen2-VL's image processor, its pixel budget).
DOTS_IMAGE = dict(min_pixels=3136, max_pixels=11289600, patch_size=14, temporal_patch_size=1, merge_size=2,
                  image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])


def build_tiny_dots_ocr(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if done(out):
        return out
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    out.mkdir(parents=True, exist_ok=True)
    fast, ids = tokenizer(out, DOTS_SPECIALS, eos="<|endoftext|>", pad="<|endoftext|>",
                          extra={"extra_special_tokens": {"image_token": "<|imgpad|>", "video_token": "<|video_pad|>"}})
    text = {k: v for k, v in TEXT.items() if k != "torch_dtype"}
    # vLLM's DotsOCRConfig is not registered for model_type dots_ocr (the hub's configuration_dots.py
    # is what loads): ours, a Qwen2 config with the vision settings, stands in.
    write_remote_config(out, dict(
        text, model_type="dots_ocr", architectures=["DotsOCRForCausalLM"], vocab_size=len(fast),
        eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"], rope_theta=10000.0,
        image_token_id=ids["<|imgpad|>"], video_token_id=ids["<|video_pad|>"], vision_config=DOTS_VISION,
        torch_dtype="bfloat16"), {}, base="qwen2", class_name="DotsOCRConfig")
    Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**DOTS_IMAGE), video_processor=Qwen2VLVideoProcessor(),
                     tokenizer=fast).save_pretrained(out)
    v = DOTS_VISION
    e, inter, p = v["embed_dim"], v["intermediate_size"], v["patch_size"]
    shapes: dict = {}
    vt = "vision_tower."
    shapes[vt + "patch_embed.patchifier.proj.weight"] = (e, 3, p, p)
    shapes[vt + "patch_embed.patchifier.proj.bias"] = (e,)
    layernorm(shapes, vt + "patch_embed.patchifier.norm", e, bias=False)
    for i in range(v["num_hidden_layers"]):
        b = f"{vt}blocks.{i}."
        layernorm(shapes, b + "norm1", e, bias=False)
        layernorm(shapes, b + "norm2", e, bias=False)
        linear(shapes, b + "attn.qkv", 3 * e, e)
        linear(shapes, b + "attn.proj", e, e)
        linear(shapes, b + "mlp.fc1", inter, e)
        linear(shapes, b + "mlp.fc3", inter, e)
        linear(shapes, b + "mlp.fc2", e, inter)
    layernorm(shapes, vt + "post_trunk_norm", e, bias=False)
    layernorm(shapes, vt + "merger.ln_q", e)
    linear(shapes, vt + "merger.mlp.0", 4 * e, 4 * e, bias=True)
    linear(shapes, vt + "merger.mlp.2", TEXT["hidden_size"], 4 * e, bias=True)
    llama_lm_shapes(shapes, "", len(fast), qkv_bias=True)
    save_random(out, shapes, seed)
    return finish(out)


# --- GLM-4V (glm-4v-9b) ---------------------------------------------------------------------------
# model_type chatglm: vLLM registers its own ChatGLMConfig, and GLM4VForCausalLM (the recipe's
# hf_overrides) builds GLM4VProcessor itself from vision_config's image_size: config.json is enough.
# GLM-4's tokens; the image is `<|begin_of_image|><|endoftext|><|end_of_image|>` (pad = the image token).
GLM4V_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>"]
# EVA2-CLIP at tiny width: 112-px images, patch 14 (8x8 + CLS positions), a 2x2 conv: 16 tokens + boi/eoi.
GLM4V_VISION = dict(in_channels=3, hidden_size=64, num_heads=1, intermediate_size=128, num_hidden_layers=2,
                    patch_size=14, image_size=112, num_positions=(112 // 14) ** 2 + 1, layer_norm_eps=1e-6,
                    hidden_act="gelu", dropout_prob=0.0, scaling_factor=8)


def build_tiny_glm4v_chatglm(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if done(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    fast, ids = tokenizer(out, GLM4V_SPECIALS, eos="<|endoftext|>", pad="<|endoftext|>")
    h, ffn, heads, groups = TEXT["hidden_size"], TEXT["intermediate_size"], TEXT["num_attention_heads"], 2
    kv = TEXT["head_dim"]
    # glm-4v-9b's config.json at tiny widths (its architectures: the text class; the recipe overrides it).
    write_json(out / "config.json", dict(
        model_type="chatglm", architectures=["ChatGLMModel"], num_layers=TEXT["num_hidden_layers"],
        padded_vocab_size=len(fast), hidden_size=h, ffn_hidden_size=ffn, kv_channels=kv, num_attention_heads=heads,
        seq_length=8192, layernorm_epsilon=1.5625e-07, rmsnorm=True, apply_residual_connection_post_layernorm=False,
        post_layer_norm=True, add_bias_linear=False, add_qkv_bias=True, multi_query_attention=True,
        multi_query_group_num=groups, original_rope=True, rope_ratio=1, fp32_residual_connection=False,
        tie_word_embeddings=False, torch_dtype="bfloat16", vision_config=GLM4V_VISION,
        boi_token_id=ids["<|begin_of_image|>"], eoi_token_id=ids["<|end_of_image|>"], pad_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]))
    shapes: dict = {}
    t = "transformer."
    shapes[t + "embedding.word_embeddings.weight"] = (len(fast), h)
    for i in range(TEXT["num_hidden_layers"]):
        layer = f"{t}encoder.layers.{i}."
        layernorm(shapes, layer + "input_layernorm", h, bias=False)
        layernorm(shapes, layer + "post_attention_layernorm", h, bias=False)
        linear(shapes, layer + "self_attention.query_key_value", (heads + 2 * groups) * kv, h, bias=True)
        linear(shapes, layer + "self_attention.dense", h, heads * kv)
        linear(shapes, layer + "mlp.dense_h_to_4h", 2 * ffn, h)
        linear(shapes, layer + "mlp.dense_4h_to_h", h, ffn)
    layernorm(shapes, t + "encoder.final_layernorm", h, bias=False)
    shapes[t + "output_layer.weight"] = (len(fast), h)
    v = GLM4V_VISION
    e, p, vi = v["hidden_size"], v["patch_size"], t + "vision."
    shapes[vi + "patch_embedding.proj.weight"] = (e, 3, p, p)
    shapes[vi + "patch_embedding.proj.bias"] = (e,)
    shapes[vi + "patch_embedding.cls_embedding"] = (1, e)
    shapes[vi + "patch_embedding.position_embedding.weight"] = (v["num_positions"], e)
    for i in range(v["num_hidden_layers"]):
        layer = f"{vi}transformer.layers.{i}."
        layernorm(shapes, layer + "input_layernorm", e)
        layernorm(shapes, layer + "post_attention_layernorm", e)
        linear(shapes, layer + "attention.query_key_value", 3 * e, e, bias=True)
        linear(shapes, layer + "attention.dense", e, e, bias=True)
        linear(shapes, layer + "mlp.fc1", v["intermediate_size"], e, bias=True)
        linear(shapes, layer + "mlp.fc2", e, v["intermediate_size"], bias=True)
    shapes[vi + "conv.weight"] = (h, e, 2, 2)
    shapes[vi + "conv.bias"] = (h,)
    linear(shapes, vi + "linear_proj.linear_proj", h, h)
    layernorm(shapes, vi + "linear_proj.norm1", h)
    linear(shapes, vi + "linear_proj.gate_proj", ffn, h)
    linear(shapes, vi + "linear_proj.dense_h_to_4h", ffn, h)
    linear(shapes, vi + "linear_proj.dense_4h_to_h", h, ffn)
    shapes[vi + "boi"] = shapes[vi + "eoi"] = (1, 1, h)
    save_random(out, shapes, seed)
    return finish(out)


# --- Ovis2 (Ovis2-1B) -----------------------------------------------------------------------------
# model_type ovis: vLLM registers its own OvisConfig (and the aimv2_visual_tokenizer sub-config) and
# builds OvisProcessor from the checkpoint's image processor and tokenizer; `<image>` stays plain
# text (the processor splits the prompt on it), each image atom becomes `<|image_pad|>` tokens.
OVIS_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>"]
# AIMv2 at tiny width: 112-px partitions of patch 14 (8x8), hidden_stride 2: 16 visual tokens each.
OVIS_BACKBONE = dict(model_type="aimv2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=1, num_channels=3, image_size=112, patch_size=14, rms_norm_eps=1e-5,
                     qkv_bias=False, use_bias=False)
OVIS_VISUAL_VOCAB = 256  # the visual tokenizer's vocabulary (Ovis2-1B: 65536); its last 5 are indicators


def build_tiny_ovis(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if done(out):
        return out
    from transformers import SiglipImageProcessor

    from tests.tiny_remote_common import chatml_template, text_config

    out.mkdir(parents=True, exist_ok=True)
    fast, ids = tokenizer(out, OVIS_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>",
                          chat_template=chatml_template("You are a helpful assistant."))
    llm = text_config(fast, ids, "qwen2", "Qwen2ForCausalLM", eos="<|im_end|>")
    write_json(out / "config.json", dict(
        model_type="ovis", architectures=["Ovis"], llm_config=llm, hidden_size=TEXT["hidden_size"],
        multimodal_max_length=8192, conversation_formatter_class="QwenConversationFormatter", torch_dtype="bfloat16",
        visual_tokenizer_config=dict(model_type="aimv2_visual_tokenizer", backbone_config=OVIS_BACKBONE,
                                     vocab_size=OVIS_VISUAL_VOCAB, tokenize_function="softmax", tau=1.0,
                                     hidden_stride=2, drop_cls_token=False, depths=None)))
    side = OVIS_BACKBONE["image_size"]
    SiglipImageProcessor(size={"height": side, "width": side}, image_mean=[0.48145466, 0.4578275, 0.40821073],
                         image_std=[0.26862954, 0.26130258, 0.27577711]).save_pretrained(out)
    b = OVIS_BACKBONE
    e, inter, p = b["hidden_size"], b["intermediate_size"], b["patch_size"]
    shapes: dict = {}
    vb = "visual_tokenizer.backbone."
    shapes[vb + "preprocessor.patchifier.proj.weight"] = (e, 3, p, p)
    shapes[vb + "preprocessor.patchifier.proj.bias"] = (e,)
    layernorm(shapes, vb + "preprocessor.patchifier.norm", e, bias=False)
    shapes[vb + "preprocessor.pos_embed"] = (1, (b["image_size"] // p) ** 2, e)
    for i in range(b["num_hidden_layers"]):
        blk = f"{vb}trunk.blocks.{i}."
        linear(shapes, blk + "attn.qkv", 3 * e, e)
        linear(shapes, blk + "attn.proj", e, e)
        layernorm(shapes, blk + "norm_1", e, bias=False)
        layernorm(shapes, blk + "norm_2", e, bias=False)
        linear(shapes, blk + "mlp.fc1", inter, e)
        linear(shapes, blk + "mlp.fc3", inter, e)
        linear(shapes, blk + "mlp.fc2", e, inter)
    head = OVIS_VISUAL_VOCAB - 5
    linear(shapes, "visual_tokenizer.head.0", head, e * 4)
    layernorm(shapes, "visual_tokenizer.head.1", head)
    shapes["vte.weight"] = (OVIS_VISUAL_VOCAB, TEXT["hidden_size"])
    llama_lm_shapes(shapes, "llm.", len(fast), qkv_bias=True)
    save_random(out, shapes, seed)
    return finish(out)


# --- Ovis2.5 (Ovis2.5-2B) -------------------------------------------------------------------------
# vLLM 0.26 builds Ovis2_5Processor (processors/ovis2_5.py) from the checkpoint's image processor and
# tokenizer, but registers no config class for model_type ovis2_5: ours holds llm_config (a Qwen3
# config; vLLM reads it as text_config) and vit_config (siglip2_navit's values as attributes).
# The tokens the processor looks up in the vocabulary, and Qwen3's.
OVIS25_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>", "<image>", "<video>",
                   "<ovis_visual_atom>", "<ovis_image_start>", "<ovis_image_end>", "<ovis_video_start>",
                   "<ovis_video_end>", "<think>", "</think>"]
# SigLIP2-NaViT at tiny width: patch 16, 2x2 merge (hidden_stride), rotary positions, the original
# 512-px position table interpolated per image (Ovis2.5-2B's settings, not its sizes).
OVIS25_VIT = dict(model_type="siglip2_navit", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=1, num_channels=3, num_patches=-1, image_size=128, patch_size=16,
                  hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, attention_dropout=0.0, hidden_stride=2,
                  window_size=112, fullatt_block_indexes=None, temporal_patch_size=1, preserve_original_pe=True,
                  use_rope=True)


# vLLM's ovis2_5.py hard-codes the ids of the four start/end tokens (INDICATOR_IDS, 151672..151675:
# Ovis2.5's tokenizer) to turn them into visual-vocabulary indicators; the tiny tokenizer puts them
# there, so its vocabulary is Qwen3's size: the LM is narrower (64) and ties its head to the embedding.
OVIS25_FIXED_IDS = {"<ovis_image_start>": 151672, "<ovis_image_end>": 151673, "<ovis_video_start>": 151674,
                    "<ovis_video_end>": 151675}
OVIS25_TEXT = dict(TEXT, hidden_size=64, intermediate_size=128, tie_word_embeddings=True)


def build_tiny_ovis2_5(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if done(out):
        return out
    from transformers import SiglipImageProcessor

    from tests.tiny_remote_common import text_config

    out.mkdir(parents=True, exist_ok=True)
    fast, ids = tokenizer(out, OVIS25_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>", fixed_ids=OVIS25_FIXED_IDS)
    llm = dict(text_config(fast, ids, "qwen3", "Qwen3ForCausalLM", eos="<|im_end|>"), **OVIS25_TEXT)
    write_remote_config(out, dict(model_type="ovis2_5", architectures=["Ovis2_5"], llm_config=llm, vit_config=OVIS25_VIT,
                                  visual_vocab_size=OVIS_VISUAL_VOCAB, hidden_size=OVIS25_TEXT["hidden_size"],
                                  conversation_formatter_class="Qwen3ConversationFormatter", torch_dtype="bfloat16"),
                        {"llm_config": "qwen3", "vit_config": None}, class_name="Ovis2_5Config")
    SiglipImageProcessor(size={"height": 512, "width": 512}, image_mean=[0.5, 0.5, 0.5],
                         image_std=[0.5, 0.5, 0.5]).save_pretrained(out)
    v = OVIS25_VIT
    e = v["hidden_size"]
    shapes: dict = {}
    vm = "visual_tokenizer.vit.vision_model."
    siglip_tower_shapes(shapes, vm, v)
    head = OVIS_VISUAL_VOCAB - 4  # Ovis2.5 keeps 4 indicator tokens
    linear(shapes, "visual_tokenizer.head.0", head, e * v["hidden_stride"] ** 2)
    layernorm(shapes, "visual_tokenizer.head.1", head)
    shapes["vte.weight"] = (OVIS_VISUAL_VOCAB, OVIS25_TEXT["hidden_size"])
    llama_lm_shapes(shapes, "llm.", len(fast), OVIS25_TEXT)
    del shapes["llm.lm_head.weight"]  # tied
    for i in range(OVIS25_TEXT["num_hidden_layers"]):  # Qwen3's per-head q/k norms
        layernorm(shapes, f"llm.model.layers.{i}.self_attn.q_norm", OVIS25_TEXT["head_dim"], bias=False)
        layernorm(shapes, f"llm.model.layers.{i}.self_attn.k_norm", OVIS25_TEXT["head_dim"], bias=False)
    save_random(out, shapes, seed)
    return finish(out)
