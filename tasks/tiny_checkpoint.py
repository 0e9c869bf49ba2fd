"""Tiny random-weight LLaVA-1.5 checkpoints, for the offline demo and the tests.

Real weights cannot be downloaded everywhere (CI has no network), but the whole pipeline --
processor, placeholder expansion, vision tower, generation -- can still run for real on a model
of the right *shape*. Captions from such a model are noise; the demo says so loudly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

# Words the tokenizer is trained on: enough that prompts and random output decode to text.
_CORPUS = (
    "USER ASSISTANT Describe the content of this image in detail . What is in the picture ? "
    "a an the of and with on in at red green blue yellow circle square triangle sky grass water "
    "dog cat bird tree house car person sun cloud road field city night day small large bright "
    "dark colourful shape pattern background foreground left right top bottom centre text"
)
IMAGE_SIDE = 112  # pixels; with patch 14 this gives 64 image tokens per picture
PATCH = 14


def train_tokenizer(special_tokens: list[str]):
    """A byte-level BPE tokenizer trained in-process; every string encodes and decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # the demo's terminal shows the run, not a tokenizer's training
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def save_fast_tokenizer(tok, out: Path, *, eos: str, bos: str | None = None, pad: str | None = None,
                        unk: str | None = None, extra: dict | None = None):
    """Wrap a trained tokenizer as a `PreTrainedTokenizerFast` and save it; pad defaults to eos."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad or eos,
        **(extra or {}),
    )
    fast.save_pretrained(out)
    return fast


# LLaVA-1.5's chat template as llava-hf ships it (images first, then the text; `USER:` /
# `ASSISTANT:`): the multi-image recipe renders LLaVA through it.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
# Random-weight LLaVA-1.5 shapes: "tiny" (~2 MB, for CPU tests and the demo) and "7b" (the
# real LLaVA-1.5-7B's CLIP ViT-L/14-336 and Llama-2-7B sizes, ~14 GB in bf16, for GPU benches).
SHAPES = {
    "tiny": {"vision": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
                            image_size=IMAGE_SIDE, patch_size=PATCH, projection_dim=64),
             "text": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=2),
             "image_side": IMAGE_SIDE, "dtype": "float32"},
    "7b": {"vision": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                          image_size=336, patch_size=PATCH, projection_dim=768),
           "text": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=32),
           "image_side": 336, "dtype": "bfloat16"},
}


@contextlib.contextmanager
def quiet_save() -> Iterator[None]:
    """transformers' "Writing model shards" progress bar off while a checkpoint is saved: the
    demo builds one before its quiet terminal starts, and the bar is not the demo's to show."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def build_tiny_llava(out: str | Path, seed: int = 0, shape: str = "tiny") -> Path:
    """Write a random-weight LLaVA-1.5-shaped checkpoint (CLIP tower + Llama LM) to `out`, or reuse a
    complete one there. "tiny" has attention head_dim 64, which vLLM's CPU backend needs (it rejects
    16); "7b" is built on the GPU when there is one (seconds instead of minutes on a CPU)."""
    out = Path(out)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    sizes = SHAPES[shape]
    side = sizes["image_side"]
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(["<unk>", "<s>", "</s>", "<image>", "<pad>"])
    fast = save_fast_tokenizer(tok, out, bos="<s>", eos="</s>", extra={"chat_template": LLAVA_CHAT_TEMPLATE})
    image_token_id = fast.convert_tokens_to_ids("<image>")

    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**sizes["vision"]),
        text_config=LlamaConfig(
            vocab_size=len(fast), max_position_embeddings=2048 if shape == "tiny" else 4096,
            bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
            pad_token_id=fast.pad_token_id, torch_dtype=sizes["dtype"], **sizes["text"],
        ),
        image_token_index=image_token_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        image_seq_length=(side // PATCH) ** 2,
    )
    device = "cuda" if shape != "tiny" and torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlavaForConditionalGeneration(config).to(getattr(torch, sizes["dtype"])).eval()
    with quiet_save():
        model.save_pretrained(out, safe_serialization=True, max_shard_size="100GB")  # one file
    del model
    to_hub_layout(out / "model.safetensors")

    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side},
        ),
        tokenizer=fast,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    (out / "TINY_RANDOM_WEIGHTS").write_text("Random weights: outputs are noise.\n")
    return out


def to_hub_layout(path: Path) -> None:
    """transformers 5 saves the CLIP tower as `vision_tower.*` (or `model.vision_tower.*`);
    vLLM 0.26 loads the hub layout: `vision_tower.vision_model.*`, `language_model.model.*`,
    `language_model.lm_head.*`, `multi_modal_projector.*` (LLaVA, LLaVA-NeXT, PaliGemma, Gemma 3)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    renamed = {}
    for key, value in tensors.items():
        new = key.removeprefix("model.")
        if new.startswith("vision_tower.") and not new.startswith("vision_tower.vision_model."):
            new = "vision_tower.vision_model." + new[len("vision_tower."):]
        elif new.startswith("language_model.") and not new.startswith(
            ("language_model.model.", "language_model.lm_head.")
        ):
            new = "language_model.model." + new[len("language_model."):]
        elif new.startswith("lm_head."):
            new = "language_model." + new
        renamed[new] = value.contiguous()
    save_file(renamed, str(path), metadata={"format": "pt"})


def is_tiny_checkpoint(path: str | Path) -> bool:
    return (Path(path) / "TINY_RANDOM_WEIGHTS").exists()
