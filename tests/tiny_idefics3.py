"""A tiny random-weight Idefics3 checkpoint (SigLIP-style tower + Llama LM, image splitting)."""

from __future__ import annotations

from pathlib import Path

from tasks.tiny_checkpoint import save_fast_tokenizer, train_tokenizer

SIDE, PATCH, SCALE = 56, 14, 2  # (56/14)^2 / 2^2 = 4 tokens per tile
# Idefics3's own chat template (HuggingFaceM4/Idefics3-8B-Llama3), for the chat method.
CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SPECIALS = ["<unk>", "<|begin_of_text|>", "<end_of_utterance>", "<image>", "<fake_token_around_image>",
            "<global-img>", "<pad>"]


def build_tiny_idefics3(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor)

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    fast = save_fast_tokenizer(train_tokenizer(SPECIALS), out, bos="<|begin_of_text|>",
                               eos="<end_of_utterance>", pad="<pad>", unk="<unk>",
                               extra={"chat_template": CHAT_TEMPLATE})
    config = Idefics3Config(
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
                           image_size=SIDE, patch_size=PATCH),
        text_config=dict(model_type="llama", vocab_size=len(fast), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=8192, pad_token_id=fast.pad_token_id,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id),
        image_token_id=fast.convert_tokens_to_ids("<image>"), scale_factor=SCALE,
        pad_token_id=fast.pad_token_id,
    )
    Idefics3ForConditionalGeneration(config).eval().save_pretrained(out)
    image_processor = Idefics3ImageProcessor(size={"longest_edge": 2 * SIDE},
                                             max_image_size={"longest_edge": SIDE})
    Idefics3Processor(image_processor=image_processor, tokenizer=fast,
                      image_seq_len=(SIDE // PATCH) ** 2 // SCALE**2,
                      chat_template=CHAT_TEMPLATE).save_pretrained(out)
    return out
