"""A tiny random-weight Gemma 3 checkpoint (SigLIP tower + Gemma 3 LM) with a Gemma-style chat template."""

from __future__ import annotations

from pathlib import Path

from vlm_caption.tasks.tiny_checkpoint import save_fast_tokenizer, to_hub_layout, train_tokenizer

SIDE, PATCH, TOKENS = 56, 14, 4  # 4x4 patches pooled to 2x2 soft tokens per image
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
            "<end_of_image>", "<image_soft_token>"]
# The shape of Gemma 3's own template: image parts become <start_of_image>, turns are
# <start_of_turn>role ... <end_of_turn>, and the assistant role is called "model".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build_tiny_gemma3(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if (out / "model.safetensors").exists():
        return out
    import torch
    from tokenizers import AddedToken
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor,
                              Gemma3Processor, Gemma3TextConfig, SiglipVisionConfig)

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(SPECIALS)
    # Gemma's vocabulary has runs of newlines as single tokens; vLLM's Gemma 3 processor merges them.
    tok.add_tokens([AddedToken("\n" * n, normalized=False) for n in (1, 2, 3, 4)])
    fast = save_fast_tokenizer(
        tok, out, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
        extra={"chat_template": CHAT_TEMPLATE,
               "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                        "image_token": "<image_soft_token>"}},
    )
    ids = {t: fast.convert_tokens_to_ids(t) for t in SPECIALS}
    config = Gemma3Config(
        text_config=Gemma3TextConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256,
                                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                     head_dim=64, max_position_embeddings=4096, sliding_window=512,
                                     layer_types=["sliding_attention", "full_attention"],
                                     bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
                                     pad_token_id=ids["<pad>"]),
        vision_config=SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=1, image_size=SIDE, patch_size=PATCH,
                                         vision_use_head=False),
        mm_tokens_per_image=TOKENS, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"],
    )
    Gemma3ForConditionalGeneration(config).eval().save_pretrained(out)
    to_hub_layout(out / "model.safetensors")
    Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": SIDE, "width": SIDE}),
                    tokenizer=fast, chat_template=CHAT_TEMPLATE, image_seq_length=TOKENS).save_pretrained(out)
    return out
