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
