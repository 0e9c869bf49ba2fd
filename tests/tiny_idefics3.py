"""Tiny random-weight Idefics3 and SmolVLM checkpoints (SigLIP-style tower + Llama LM, image splitting).

The processor side is the real models': recipes pass `size` / `max_image_size` in real pixels, so
tiles are the real size (364 px for Idefics3, 384 for SmolVLM) and the tokenizer carries the real
`<row_i_col_j>` markers (1..6, as the hub tokenizers and transformers' processors expect). Only the
widths and depths are tiny.
"""

from __future__ import annotations

from pathlib import Path

from vlm_caption.tasks.tiny_checkpoint import save_fast_tokenizer, train_tokenizer

# Idefics3-8B-Llama3: 364-px tiles, patch 14, pixel shuffle 2 -> (26 * 26) / 4 = 169 tokens per tile;
# images resized to at most 4 tiles a side.
IDEFICS3 = dict(tile=364, patch=14, scale=2, longest_edge=4 * 364)
# Idefics3's own chat template (HuggingFaceM4/Idefics3-8B-Llama3), for the chat method.
CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# Tile markers the processors write for a grid of up to 6 x 6 tiles.
ROW_COL = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
IMAGE_SPECIALS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", *ROW_COL]


def build_tiny_idefics3(out: Path, seed: int = 0) -> Path:
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor, Idefics3Processor

    def processor(fast, tile, seq_len):
        image_processor = Idefics3ImageProcessor(size={"longest_edge": IDEFICS3["longest_edge"]},
                                                 max_image_size={"longest_edge": tile})
        return Idefics3Processor(image_processor=image_processor, tokenizer=fast, image_seq_len=seq_len,
                                 chat_template=CHAT_TEMPLATE)

    return build_idefics_family(out, seed, Idefics3Config, Idefics3ForConditionalGeneration, processor,
                                specials=["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<pad>"],
                                bos="<|begin_of_text|>", chat_template=CHAT_TEMPLATE, **IDEFICS3)


def build_idefics_family(out: Path, seed: int, config_cls, model_cls, make_processor, *, specials: list[str],
                         bos: str, tile: int, patch: int, scale: int, chat_template: str | None = None,
                         **_: object) -> Path:
    """One builder for Idefics3-style models: `make_processor(tokenizer, tile, image_seq_len)`."""
    out = Path(out)
    if (out / "model.safetensors").exists():
        return out
    import torch

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    extra = {"chat_template": chat_template} if chat_template else {}
    fast = save_fast_tokenizer(train_tokenizer(specials + IMAGE_SPECIALS), out, bos=bos, eos="<end_of_utterance>",
                               pad="<pad>", unk="<unk>", extra=extra)
    seq_len = (tile // patch) ** 2 // scale**2
    config = config_cls(
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
                           image_size=tile, patch_size=patch),
        text_config=dict(model_type="llama", vocab_size=len(fast), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=16384, pad_token_id=fast.pad_token_id,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id),
        image_token_id=fast.convert_tokens_to_ids("<image>"), scale_factor=scale, pad_token_id=fast.pad_token_id,
    )
    model_cls(config).eval().save_pretrained(out)
    make_processor(fast, tile, seq_len).save_pretrained(out)
    (out / "TINY_RANDOM_WEIGHTS").write_text("Random weights: outputs are noise.\n")
    return out
