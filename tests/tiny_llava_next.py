"""A tiny random-weight LLaVA-NeXT checkpoint (CLIP tower + Mistral LM, any-resolution tiling)."""

from __future__ import annotations

from pathlib import Path

from vlm_caption.tasks.tiny_checkpoint import save_fast_tokenizer, to_hub_layout, train_tokenizer

SIDE, PATCH = 56, 14  # 16 tokens per tile; a 160x120 picture becomes base + 2x2 tiles
PINPOINTS = [[SIDE, SIDE], [SIDE, 2 * SIDE], [2 * SIDE, SIDE], [2 * SIDE, 2 * SIDE]]


def build_tiny_llava_next(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import (CLIPVisionConfig, LlavaNextConfig, LlavaNextForConditionalGeneration,
                              LlavaNextImageProcessor, LlavaNextProcessor, MistralConfig)

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    fast = save_fast_tokenizer(train_tokenizer(["<unk>", "<s>", "</s>", "<image>"]), out,
                               bos="<s>", eos="</s>", unk="<unk>")
    config = LlavaNextConfig(
        vision_config=CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=1, image_size=SIDE, patch_size=PATCH,
                                       projection_dim=64),
        text_config=MistralConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                  head_dim=64, max_position_embeddings=4096, sliding_window=None,
                                  bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                                  pad_token_id=fast.pad_token_id),
        image_token_index=fast.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2, vision_feature_select_strategy="default",
    )
    LlavaNextForConditionalGeneration(config).eval().save_pretrained(out)
    to_hub_layout(out / "model.safetensors")
    LlavaNextProcessor(
        image_processor=LlavaNextImageProcessor(size={"shortest_edge": SIDE},
                                                crop_size={"height": SIDE, "width": SIDE},
                                                image_grid_pinpoints=PINPOINTS),
        tokenizer=fast, patch_size=PATCH, vision_feature_select_strategy="default",
        image_token="<image>", num_additional_image_tokens=1,
    ).save_pretrained(out)
    return out
