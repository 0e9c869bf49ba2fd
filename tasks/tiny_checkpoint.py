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


def train_tokenizer(special_tokens: list[str], vocab_size: int = 600):
    """A byte-level BPE tokenizer trained in-process; every string encodes and decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
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
    """Write a random-weight LLaVA-1.5-shaped checkpoint (CLIP tower + Llama LM) to `out`.

    "tiny" is chosen for vLLM's CPU backend: attention head_dim 64 (it rejects 16). "7b" is
    built on the GPU when there is one (seconds instead of minutes on a CPU).
    Idempotent: an existing complete checkpoint is reused.
    """
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
