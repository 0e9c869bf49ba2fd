"""Random-weight Qwen2-VL and Qwen2.5-VL checkpoints, at a test's size ("tiny") or a real model's
("2b", "7b", for GPU benches): the bench builds them (bench/driver.py) and so do the tests
(tests/checkpoints.py). The product never does, so they live beside it, not in it."""

from __future__ import annotations

from pathlib import Path

from vlm_caption.tasks.tiny_checkpoint import quiet_save, save_fast_tokenizer, train_tokenizer

QWEN2_VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                     "<|image_pad|>", "<|video_pad|>"]
# Qwen's ChatML with vision parts, as Qwen2-VL's processor ships it (the multi-image recipe renders it).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Random-weight Qwen2-VL shapes: "tiny" (at most 16 merged tokens per image: fast on CPU, for
# tests) and "2b" (Qwen2-VL-2B's sizes and its processor's default pixel limits, for GPU benches).
QWEN2_VL_SHAPES = {
    "tiny": {"text": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=2, mrope_section=[8, 12, 12]),
             "vision": dict(depth=2, embed_dim=64, hidden_size=128, num_heads=1),
             "max_pixels": 28 * 28 * 16, "dtype": "float32"},
    "2b": {"text": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                        num_key_value_heads=2, mrope_section=[16, 24, 24]),
           "vision": dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16),
           "max_pixels": 12845056, "dtype": "bfloat16"},
}


# Qwen2.5-VL: the same processor and prompt format, a windowed-attention vision tower with its
# own width (`hidden_size`) projected to the LM's (`out_hidden_size`). "7b": Qwen2.5-VL-7B's sizes.
QWEN2_5_VL_SHAPES = {
    "tiny": {"text": QWEN2_VL_SHAPES["tiny"]["text"],
             "vision": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=1, out_hidden_size=128,
                            fullatt_block_indexes=[1], window_size=112),
             "max_pixels": 28 * 28 * 16, "dtype": "float32"},
    "7b": {"text": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                        num_key_value_heads=4, mrope_section=[16, 24, 24]),
           "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                          fullatt_block_indexes=[7, 15, 23, 31], window_size=112, tokens_per_second=2),
           "max_pixels": 12845056, "dtype": "bfloat16"},
}
# transformers' classes per Qwen-VL generation: (config, model, processor), and its shapes.
QWEN_VL_FAMILIES = {
    "qwen2_vl": (("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"), QWEN2_VL_SHAPES),
    "qwen2_5_vl": (("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
                   QWEN2_5_VL_SHAPES),
}


def build_tiny_qwen2_vl(out: str | Path, seed: int = 0, shape: str = "tiny") -> Path:
    """Write a random-weight Qwen2-VL checkpoint (images, groups and video) to `out`."""
    return build_tiny_qwen_vl(out, "qwen2_vl", seed=seed, shape=shape)


def build_tiny_qwen2_5_vl(out: str | Path, seed: int = 0, shape: str = "tiny") -> Path:
    """Write a random-weight Qwen2.5-VL checkpoint (images, groups and video) to `out`."""
    return build_tiny_qwen_vl(out, "qwen2_5_vl", seed=seed, shape=shape)


def build_tiny_qwen_vl(out: str | Path, family: str, seed: int = 0, shape: str = "tiny") -> Path:
    out = Path(out)
    if (out / "model.safetensors").exists():
        return out
    import torch
    import transformers
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    class_names, shapes = QWEN_VL_FAMILIES[family]
    config_cls, model_cls, processor_cls = (getattr(transformers, name) for name in class_names)
    sizes = shapes[shape]
    text = dict(sizes["text"])
    mrope = text.pop("mrope_section")
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    fast = save_fast_tokenizer(train_tokenizer(QWEN2_VL_SPECIALS), out, eos="<|im_end|>", pad="<|endoftext|>",
                               extra={"chat_template": QWEN2_VL_CHAT_TEMPLATE})
    ids = {t: fast.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIALS}
    config = config_cls(
        text_config=dict(vocab_size=len(fast), max_position_embeddings=4096 if shape == "tiny" else 32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], **text),
        vision_config=dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, **sizes["vision"]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    device = "cuda" if shape != "tiny" and torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = model_cls(config).to(getattr(torch, sizes["dtype"])).eval()
    with quiet_save():
        model.save_pretrained(out, max_shard_size="100GB")
    del model
    pixels = {"min_pixels": 28 * 28, "max_pixels": sizes["max_pixels"]}
    processor_cls(image_processor=Qwen2VLImageProcessor(**pixels), video_processor=Qwen2VLVideoProcessor(**pixels),
                  tokenizer=fast, chat_template=QWEN2_VL_CHAT_TEMPLATE).save_pretrained(out)
    (out / "TINY_RANDOM_WEIGHTS").write_text("Random weights: outputs are noise.\n")
    return out
