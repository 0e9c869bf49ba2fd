"""Tiny random-weight checkpoints for LLaVA and the models built like it: a vision tower, a
projector and a language model, with `<image>`-style placeholders the processor expands.

Widths and depths are tiny (vLLM's CPU attention needs text head_dim 64); image sizes, patch
sizes, tiling and special tokens are the real models' so the recipes' prompts and
`mm_processor_kwargs` mean what they mean on the real checkpoints.
"""

from __future__ import annotations

from pathlib import Path

from vlm_caption.tasks.tiny_checkpoint import save_fast_tokenizer, to_hub_layout, train_tokenizer

MARKER = "Random weights: outputs are noise.\n"
TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=32768)
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1)
PIXTRAL_VISION = dict(VISION, head_dim=64)

LLAMA2 = ["<unk>", "<s>", "</s>"]
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MISTRAL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
COHERE = ["<PAD>", "<UNK>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
          "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|START_OF_IMG|>", "<|END_OF_IMG|>",
          "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"]

# LLaVA-OneVision's chat template as llava-hf ships it: `<|im_start|>role ` then every image and
# video placeholder, then each text part after a newline (the multi-image recipe renders it).
ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\n' + content['text'] }}"
    "{% endfor %}{% endif %}{{ '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# LLaVA-OneVision's any-resolution grid: 1x1 to 6x6 tiles of 384 px (anyres_max_9 caps the features).
ONEVISION_PINPOINTS = [[384 * h, 384 * w] for h in range(1, 7) for w in range(1, 7)]


def _done(out: Path) -> bool:
    return (out / "model.safetensors").exists()


def _tokenizer(out: Path, specials: list[str], **kwargs):
    """A trained byte-level tokenizer with every special token the prompts use, and their ids."""
    fast = save_fast_tokenizer(train_tokenizer(specials), out, **kwargs)
    return fast, {t: fast.convert_tokens_to_ids(t) for t in specials}


def _save(model, out: Path, rename: dict[str, str] | None = None, hub_layout: bool = False,
          architectures: list[str] | None = None) -> None:
    """One safetensors file; `rename` maps key prefixes to the layout vLLM's model class loads;
    `architectures` names the vLLM class where it differs from the transformers one saved."""
    import json

    model.eval().save_pretrained(out, max_shard_size="100GB")
    if architectures:  # save_pretrained writes the saving class's name
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "architectures": architectures}, indent=2) + "\n")
    path = out / "model.safetensors"
    if hub_layout:
        to_hub_layout(path)
    if rename:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(path))
        renamed = {}
        for key, value in tensors.items():
            for old, new in rename.items():
                if key.startswith(old):
                    key = new + key[len(old):]
                    break
            renamed[key] = value.contiguous()
        save_file(renamed, str(path), metadata={"format": "pt"})
    (out / "TINY_RANDOM_WEIGHTS").write_text(MARKER)


def _text(fast, ids, bos: str | None, eos: str, **extra) -> dict:
    return dict(TEXT, vocab_size=len(fast), bos_token_id=ids.get(bos) if bos else None, eos_token_id=ids[eos],
                pad_token_id=fast.pad_token_id, **extra)


def _start(out: Path, seed: int) -> Path:
    import torch

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    return out


# ---- LLaVA-NeXT-Video (CLIP ViT-L/14-336 + Vicuna; frames pooled 2x2: 144 tokens a frame) ---------
def build_tiny_llava_next_video(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if _done(out):
        return out
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaNextImageProcessor, LlavaNextVideoConfig,
                              LlavaNextVideoForConditionalGeneration, LlavaNextVideoProcessor,
                              LlavaNextVideoVideoProcessor)

    _start(out, seed)
    fast, ids = _tokenizer(out, [*LLAMA2, "<image>", "<video>"], bos="<s>", eos="</s>", unk="<unk>")
    side, patch = 336, 14
    pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    config = LlavaNextVideoConfig(
        vision_config=CLIPVisionConfig(**VISION, image_size=side, patch_size=patch, projection_dim=64),
        text_config=LlamaConfig(**_text(fast, ids, "<s>", "</s>")),
        image_token_index=ids["<image>"], video_token_index=ids["<video>"], image_grid_pinpoints=pinpoints,
        vision_feature_layer=-2, vision_feature_select_strategy="default", spatial_pool_mode="average",
        spatial_pool_stride=2, image_seq_length=576, video_seq_length=288,
    )
    _save(LlavaNextVideoForConditionalGeneration(config), out, hub_layout=True)
    crop = {"height": side, "width": side}
    LlavaNextVideoProcessor(
        video_processor=LlavaNextVideoVideoProcessor(size={"shortest_edge": side}, crop_size=crop),
        image_processor=LlavaNextImageProcessor(size={"shortest_edge": side}, crop_size=crop,
                                                image_grid_pinpoints=pinpoints),
        tokenizer=fast, patch_size=patch, vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    ).save_pretrained(out)
    return out


# ---- LLaVA-OneVision and R-4B (SigLIP-so400m 384/14 + Qwen LM, anyres_max_9 tiling) ----------------
def _onevision(out: Path, seed: int, text_config_cls: str, architectures: list[str] | None = None) -> Path:
    import transformers
    from transformers import LlavaOnevisionForConditionalGeneration

    _start(out, seed)
    fast, config = onevision_config(out, getattr(transformers, text_config_cls))
    model = LlavaOnevisionForConditionalGeneration(config)
    if architectures == ["RForConditionalGeneration"]:
        _rvl_projector(model, config)
    _save(model, out, hub_layout=True, architectures=architectures)
    save_onevision_processor(out, fast)
    return out


ONEVISION_SIDE = 384


def onevision_config(out: Path, text_cls):
    """LLaVA-OneVision's tokenizer (written to `out`) and config, its LM of class `text_cls`
    (also Bee's, tests/tiny_remote_native.py)."""
    from transformers import LlavaOnevisionConfig, SiglipVisionConfig

    fast, ids = _tokenizer(out, [*CHATML, "<image>", "<video>"], eos="<|im_end|>", pad="<|endoftext|>",
                           extra={"chat_template": ONEVISION_CHAT_TEMPLATE})
    config = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**VISION, image_size=ONEVISION_SIDE, patch_size=14, vision_use_head=False),
        text_config=text_cls(**_text(fast, ids, None, "<|im_end|>")),
        image_token_index=ids["<image>"], video_token_index=ids["<video>"], image_grid_pinpoints=ONEVISION_PINPOINTS,
        vision_feature_layer=-1, vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
    )
    return fast, config


def save_onevision_processor(out: Path, fast) -> None:
    from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor

    size = {"height": ONEVISION_SIDE, "width": ONEVISION_SIDE}
    LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=ONEVISION_PINPOINTS),
        video_processor=LlavaOnevisionVideoProcessor(size=size),
        tokenizer=fast, num_image_tokens=(ONEVISION_SIDE // 14) ** 2, vision_feature_select_strategy="full",
        chat_template=ONEVISION_CHAT_TEMPLATE,
    ).save_pretrained(out)


def _rvl_projector(model, config) -> None:
    """R-4B's projector is LLaVA-OneVision's with a LayerNorm in front (`pre_norm`, vLLM's
    RVLMultiModalProjector); transformers has no R-4B class, so the norm is added to the module."""
    import torch.nn as nn

    model.model.multi_modal_projector.pre_norm = nn.LayerNorm(config.vision_config.hidden_size, eps=1e-6)


def build_tiny_llava_onevision(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    return out if _done(out) else _onevision(out, seed, "Qwen2Config")


def build_tiny_rvl(out: Path, seed: int = 0) -> Path:
    """R-4B (YannQi/R-4B): LLaVA-OneVision's layout and processor with a Qwen3 LM. Its hub config
    needs its own code; here the config is transformers' LlavaOnevisionConfig with the
    architecture vLLM registers (RForConditionalGeneration reads only fields it has)."""
    out = Path(out)
    return out if _done(out) else _onevision(out, seed, "Qwen3Config", ["RForConditionalGeneration"])


# ---- Mantis-8B-siglip-llama3 (LLaVA with SigLIP 384/14 + Llama 3; 729 tokens an image) -----------
def build_tiny_mantis(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if _done(out):
        return out
    from transformers import (LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor,
                              SiglipImageProcessor, SiglipVisionConfig)

    _start(out, seed)
    fast, ids = _tokenizer(out, [*LLAMA3, "<image>", "<pad>"], bos="<|begin_of_text|>", eos="<|eot_id|>",
                           pad="<pad>")
    side, patch = 384, 14
    config = LlavaConfig(
        vision_config=SiglipVisionConfig(**VISION, image_size=side, patch_size=patch, vision_use_head=False),
        text_config=LlamaConfig(**_text(fast, ids, "<|begin_of_text|>", "<|eot_id|>")),
        image_token_index=ids["<image>"], vision_feature_layer=-1, vision_feature_select_strategy="full",
        projector_hidden_act="gelu", image_seq_length=(side // patch) ** 2,
    )
    _save(LlavaForConditionalGeneration(config), out, hub_layout=True)
    LlavaProcessor(
        image_processor=SiglipImageProcessor(size={"height": side, "width": side}),
        tokenizer=fast, patch_size=patch, vision_feature_select_strategy="full", image_token="<image>",
        num_additional_image_tokens=0,
    ).save_pretrained(out)
    return out


# ---- Pixtral (HF format), Mistral Small 3.1, LightOnOCR: Pixtral tower, [IMG] rows ------------------
def _pixtral_processor(out: Path, fast, *, longest_edge: int, patch: int, merge: int, image_token: str = "[IMG]",
                       image_break_token: str = "[IMG_BREAK]", image_end_token: str = "[IMG_END]") -> None:
    from transformers import PixtralImageProcessor, PixtralProcessor

    PixtralProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": longest_edge},
                                              patch_size={"height": patch, "width": patch}),
        tokenizer=fast, patch_size=patch, spatial_merge_size=merge, image_token=image_token,
        image_break_token=image_break_token, image_end_token=image_end_token,
    ).save_pretrained(out)


def build_tiny_pixtral_hf(out: Path, seed: int = 0) -> Path:
    """mistral-community/pixtral-12b: LlavaForConditionalGeneration with a Pixtral tower (1024 px,
    16 px patches, no merge) and a Mistral LM."""
    out = Path(out)
    if _done(out):
        return out
    from transformers import (LlavaConfig, LlavaForConditionalGeneration, MistralConfig, PixtralVisionConfig)

    _start(out, seed)
    fast, ids = _tokenizer(out, MISTRAL, bos="<s>", eos="</s>", unk="<unk>")
    side, patch = 1024, 16
    config = LlavaConfig(
        vision_config=PixtralVisionConfig(**PIXTRAL_VISION, image_size=side, patch_size=patch),
        text_config=MistralConfig(**_text(fast, ids, "<s>", "</s>", sliding_window=None)),
        image_token_index=ids["[IMG]"], vision_feature_layer=-1, vision_feature_select_strategy="full",
        projector_hidden_act="gelu", multimodal_projector_bias=True,
    )
    _save(LlavaForConditionalGeneration(config), out)  # vLLM's Llava mapper reads transformers 5 names
    _pixtral_processor(out, fast, longest_edge=side, patch=patch, merge=1)
    return out


def _mistral3(out: Path, seed: int, *, specials, text_cls: str, text_extra: dict, bos, eos, image_token: str,
              architectures: list[str], processor: dict, **tok) -> Path:
    import transformers
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig

    _start(out, seed)
    fast, ids = _tokenizer(out, specials, bos=bos, eos=eos, **tok)
    config = Mistral3Config(
        vision_config=PixtralVisionConfig(**PIXTRAL_VISION, image_size=1540, patch_size=14),
        text_config=getattr(transformers, text_cls)(**_text(fast, ids, bos, eos, **text_extra)),
        image_token_index=ids[image_token], spatial_merge_size=2, vision_feature_layer=-1,
        projector_hidden_act="gelu", multimodal_projector_bias=False, tie_word_embeddings=False,
    )
    _save(Mistral3ForConditionalGeneration(config), out, architectures=architectures)
    _pixtral_processor(out, fast, longest_edge=1540, patch=14, merge=2, image_token=image_token, **processor)
    return out


def build_tiny_mistral3(out: Path, seed: int = 0) -> Path:
    """Mistral-Small-3.1: Pixtral tower (1540 px, 14 px patches) merged 2x2, Mistral LM."""
    out = Path(out)
    if _done(out):
        return out
    return _mistral3(out, seed, specials=MISTRAL, text_cls="MistralConfig", text_extra={"sliding_window": None},
                     bos="<s>", eos="</s>", unk="<unk>", image_token="[IMG]",
                     architectures=["Mistral3ForConditionalGeneration"], processor={})


def build_tiny_lightonocr(out: Path, seed: int = 0) -> Path:
    """LightOnOCR-1B: Mistral 3's layout (its hub config is a `mistral3` one) with a Qwen3 LM and
    Qwen's vision tokens; vLLM drops the row-break/end tokens the Pixtral processor inserts.
    (vLLM also maps the hub's `model.vision_encoder.`/`model.vision_projection.` names; the
    layout transformers saves loads as it is.)"""
    out = Path(out)
    if _done(out):
        return out
    return _mistral3(out, seed, specials=[*CHATML, "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                                          "<|image_pad|>"],
                     text_cls="Qwen3Config", text_extra={}, bos=None, eos="<|im_end|>", pad="<|endoftext|>",
                     image_token="<|image_pad|>", architectures=["LightOnOCRForConditionalGeneration"],
                     processor={"image_break_token": "<|vision_pad|>", "image_end_token": "<|vision_end|>"})


# ---- Aya Vision and Command A Vision (SigLIP tower, pixel-shuffle 2x2, Cohere 2 LM, tiles) -------
def _cohere_text(fast, ids):
    from transformers import Cohere2Config

    return Cohere2Config(**_text(fast, ids, "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"), sliding_window=4096,
                         layer_types=["sliding_attention", "full_attention"])


def build_tiny_aya_vision(out: Path, seed: int = 0) -> Path:
    """aya-vision-8b: SigLIP 364/14, 2x2 pixel shuffle (169 tokens a tile), up to 12 tiles + a
    thumbnail. vLLM 0.26 runs it through its Transformers backend (no native class)."""
    out = Path(out)
    if _done(out):
        return out
    from transformers import (AyaVisionConfig, AyaVisionForConditionalGeneration, AyaVisionProcessor,
                              GotOcr2ImageProcessor, SiglipVisionConfig)

    _start(out, seed)
    # The processor writes "TILE_1".."TILE_12" and "TILE_GLOBAL" before each tile's patches; its
    # image tokens (`image_token_ids`, which vLLM's Transformers backend counts) include "TILE" and
    # "TILE_GLOBAL" as single tokens, one "TILE" a tile.
    fast, ids = _tokenizer(out, [*COHERE, "<image>", "TILE", "TILE_GLOBAL"], bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>",
                           pad="<PAD>", unk="<UNK>")
    side, patch = 364, 14
    config = AyaVisionConfig(
        vision_config=SiglipVisionConfig(**VISION, image_size=side, patch_size=patch, vision_use_head=False),
        text_config=_cohere_text(fast, ids), image_token_index=ids["<|IMG_PATCH|>"], downsample_factor=2,
        vision_feature_layer=-1, vision_feature_select_strategy="full",
    )
    _save(AyaVisionForConditionalGeneration(config), out)
    AyaVisionProcessor(
        image_processor=GotOcr2ImageProcessor(size={"height": side, "width": side}, crop_to_patches=True,
                                              min_patches=1, max_patches=12),
        tokenizer=fast, patch_size=patch, img_size=side, downsample_factor=2,  # (364 / 28)^2 = 169 a tile
    ).save_pretrained(out)
    return out


def build_tiny_cohere2_vision(out: Path, seed: int = 0) -> Path:
    """command-a-vision-07-2025: SigLIP 512/16, 2x2 pixel shuffle (256 tokens a tile), up to 12
    tiles + a thumbnail; `<|IMG_PATCH|>` is both the prompt's placeholder and the image token."""
    out = Path(out)
    if _done(out):
        return out
    from transformers import (Cohere2VisionConfig, Cohere2VisionForConditionalGeneration,
                              Cohere2VisionImageProcessor, Cohere2VisionProcessor, SiglipVisionConfig)

    _start(out, seed)
    fast, ids = _tokenizer(out, COHERE, bos="<BOS_TOKEN>", eos="<|END_OF_TURN_TOKEN|>", pad="<PAD>", unk="<UNK>",
                           extra={"extra_special_tokens": {"boi_token": "<|START_OF_IMG|>",
                                                           "eoi_token": "<|END_OF_IMG|>",
                                                           "image_token": "<|IMG_PATCH|>",
                                                           "img_line_break_token": "<|IMG_LINE_BREAK|>"}})
    side, patch = 512, 16
    config = Cohere2VisionConfig(
        vision_config=SiglipVisionConfig(**VISION, image_size=side, patch_size=patch, vision_use_head=False),
        text_config=_cohere_text(fast, ids), image_token_id=ids["<|IMG_PATCH|>"], downsample_factor=2,
        alignment_intermediate_size=256,
    )
    # vLLM's SigLIP tower keeps the `vision_model.` level transformers 5 no longer saves.
    _save(Cohere2VisionForConditionalGeneration(config), out,
          rename={"model.vision_tower.": "model.vision_tower.vision_model."})
    Cohere2VisionProcessor(
        image_processor=Cohere2VisionImageProcessor(size={"height": side, "width": side}, patch_size=patch,
                                                    crop_to_patches=True, min_patches=1, max_patches=12),
        tokenizer=fast,
    ).save_pretrained(out)
    return out
