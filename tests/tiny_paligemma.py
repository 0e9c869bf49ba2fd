"""A tiny random-weight PaliGemma checkpoint (SigLIP tower + Gemma LM)."""

from __future__ import annotations

from pathlib import Path

from vlm_caption.tasks.tiny_checkpoint import save_fast_tokenizer, to_hub_layout, train_tokenizer

SIDE, PATCH = 56, 14  # 16 image tokens


def build_tiny_paligemma(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import (GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration,
                              PaliGemmaProcessor, SiglipImageProcessor,
                              SiglipVisionConfig)

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    fast = save_fast_tokenizer(train_tokenizer(["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]), out,
                               bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>")
    image_processor = SiglipImageProcessor(size={"height": SIDE, "width": SIDE})
    image_processor.image_seq_length = (SIDE // PATCH) ** 2
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=fast)  # adds <loc>/<seg> tokens
    tokenizer = processor.tokenizer
    config = PaliGemmaConfig(
        vision_config=SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=1, image_size=SIDE, patch_size=PATCH,
                                         projection_dim=128),
        text_config=GemmaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                head_dim=64, max_position_embeddings=2048,
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        projection_dim=128, hidden_size=128,
    )
    PaliGemmaForConditionalGeneration(config).eval().save_pretrained(out)
    to_hub_layout(out / "model.safetensors")
    processor.save_pretrained(out)
    return out
