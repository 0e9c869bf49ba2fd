"""A tiny random-weight Qwen2-VL checkpoint (image and video) for the real-processor matrix."""

from __future__ import annotations

from pathlib import Path

from tasks.tiny_checkpoint import save_fast_tokenizer, train_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
PIXELS = 28 * 28 * 16  # at most 16 merged tokens per image: fast on CPU


def build_tiny_qwen2_vl(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import (Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    fast = save_fast_tokenizer(train_tokenizer(SPECIALS), out, eos="<|im_end|>", pad="<|endoftext|>")
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [8, 12, 12]},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=128, num_heads=1, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    Qwen2VLForConditionalGeneration(config).eval().save_pretrained(out)
    Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=PIXELS),
        video_processor=Qwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=PIXELS),
        tokenizer=fast,
    ).save_pretrained(out)
    return out
