"""Tiny random-weight checkpoints for Google, Meta, Hugging Face and early VLMs.

PaliGemma 2, SmolVLM, Gemma 3n, Llama 4, BLIP-2 and Chameleon: transformers' own config and
model classes at tiny widths and depths, with the REAL processor geometry (image sizes, patch
sizes, tokens per image, special tokens), because recipes pass `mm_processor_kwargs` in the real
model's units and prompts use the real special tokens. Text attention head_dim is 64 (vLLM's CPU
attention rejects 16). Mllama and Fuyu are no longer implemented by vLLM 0.26: their builders
raise with vLLM's own registry entry as the reason.
"""

from __future__ import annotations

from pathlib import Path

from vlm_caption.tasks.tiny_checkpoint import save_fast_tokenizer, to_hub_layout, train_tokenizer

MARKER = "Random weights: outputs are noise.\n"
# A small Llama-like LM: 2 layers, head_dim 64.
TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2)
# A one-layer vision tower; the image/patch sizes come from each real model.
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1)


def _done(out: Path, weights: str = "model.safetensors") -> bool:
    return (out / weights).exists() and (out / "TINY_RANDOM_WEIGHTS").exists()


def _finish(out: Path) -> Path:
    (out / "TINY_RANDOM_WEIGHTS").write_text(MARKER)
    return out


def _removed_from_vllm(architecture: str) -> None:
    """vLLM keeps a list of architectures it dropped; a checkpoint for one could never load."""
    from vllm import __version__
    from vllm.model_executor.models.registry import _PREVIOUSLY_SUPPORTED_MODELS

    last = _PREVIOUSLY_SUPPORTED_MODELS.get(architecture)
    if last:
        raise NotImplementedError(f"vLLM {__version__} does not implement {architecture} (its registry lists "
                                  f"it as supported until v{last})")


# --- PaliGemma 2: SigLIP + Gemma 2, 448 px (google/paligemma2-3b-ft-docci-448) -----------------------

def build_tiny_paligemma2(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if _done(out):
        return out
    import torch
    from transformers import (Gemma2Config, PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor,
                              SiglipImageProcessor, SiglipVisionConfig)

    side, patch = 448, 14  # 32 x 32 = 1024 image tokens, as the real 448-px checkpoint
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    fast = save_fast_tokenizer(train_tokenizer(["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]), out,
                               bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>")
    image_processor = SiglipImageProcessor(size={"height": side, "width": side}, image_mean=[0.5] * 3,
                                           image_std=[0.5] * 3)
    image_processor.image_seq_length = (side // patch) ** 2
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=fast)  # adds <loc>/<seg> tokens
    tok = processor.tokenizer
    config = PaliGemmaConfig(
        vision_config=SiglipVisionConfig(**VISION, image_size=side, patch_size=patch, projection_dim=128),
        text_config=Gemma2Config(vocab_size=len(tok), **TEXT, num_key_value_heads=1, head_dim=64,
                                 query_pre_attn_scalar=64, sliding_window=512, max_position_embeddings=4096,
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id),
        image_token_index=tok.convert_tokens_to_ids("<image>"), projection_dim=128, hidden_size=128,
    )
    PaliGemmaForConditionalGeneration(config).eval().save_pretrained(out)
    to_hub_layout(out / "model.safetensors")
    processor.save_pretrained(out)
    return _finish(out)


# --- SmolVLM 2 (HuggingFaceTB/SmolVLM2-2.2B-Instruct): Idefics3's layout, 384-px tiles ---------------

def build_tiny_smolvlm(out: Path, seed: int = 0) -> Path:
    from transformers import (SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessor,
                              SmolVLMProcessor, SmolVLMVideoProcessor)

    from tests.tiny_idefics3 import build_idefics_family

    # 384-px tiles, patch 14 (27 x 27 patches), pixel shuffle 3 -> 81 tokens per tile; up to 4 tiles a side.
    tile, longest = 384, 4 * 384

    def processor(fast, tile, seq_len):
        return SmolVLMProcessor(
            image_processor=SmolVLMImageProcessor(size={"longest_edge": longest},
                                                  max_image_size={"longest_edge": tile}),
            video_processor=SmolVLMVideoProcessor(size={"longest_edge": tile},
                                                  max_image_size={"longest_edge": tile}),
            tokenizer=fast, image_seq_len=seq_len)

    return build_idefics_family(out, seed, SmolVLMConfig, SmolVLMForConditionalGeneration, processor,
                                specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<pad>", "<video>"],
                                bos="<|im_start|>", tile=tile, patch=14, scale=3)


# --- BLIP-2 (Salesforce/blip2-opt-2.7b): ViT + Q-Former + OPT, 32 query tokens ------------------------

def build_tiny_blip2(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if _done(out):
        return out
    import torch
    from transformers import (Blip2Config, Blip2ForConditionalGeneration, Blip2Processor, BlipImageProcessor,
                              OPTConfig)

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    # OPT's vocabulary starts <s>, <pad>, </s>, <unk>; BOS and EOS are both </s>.
    fast = save_fast_tokenizer(train_tokenizer(["<s>", "<pad>", "</s>", "<unk>", "<image>"]), out,
                               bos="</s>", eos="</s>", pad="<pad>", unk="<unk>")
    config = Blip2Config(
        vision_config=dict(**VISION, image_size=224, patch_size=14),
        qformer_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
                            encoder_hidden_size=64),
        text_config=OPTConfig(vocab_size=len(fast), hidden_size=128, ffn_dim=256, num_hidden_layers=2,
                              num_attention_heads=2, word_embed_proj_dim=128, max_position_embeddings=2048,
                              bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                              pad_token_id=fast.pad_token_id),
        num_query_tokens=32, image_token_index=fast.convert_tokens_to_ids("<image>"),
    )
    Blip2ForConditionalGeneration(config).eval().save_pretrained(out)
    Blip2Processor(image_processor=BlipImageProcessor(size={"height": 224, "width": 224}), tokenizer=fast,
                   num_query_tokens=32).save_pretrained(out)
    return _finish(out)


# --- Chameleon (facebook/chameleon-7b): VQ-VAE image tokens in the LM's vocabulary ---------------------

def _chameleon_code_name(index: int) -> str:
    """The hub vocabulary names codebook entry 123 `IMGIMGBCDZ` (digits as letters A-J)."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(index)) + "Z"


def build_tiny_chameleon(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if _done(out):
        return out
    import torch
    from tokenizers import AddedToken
    from transformers import (ChameleonConfig, ChameleonForConditionalGeneration, ChameleonImageProcessor,
                              ChameleonProcessor)

    codes = 64  # codebook entries (8192 real); each is a token of the LM's vocabulary
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(["<s>", "</s>", "<pad>", "<unk>", "<reserved08706>", "<image>", "<racm3:break>", "<eoss>"])
    tok.add_tokens([AddedToken(_chameleon_code_name(i), normalized=False) for i in range(codes)])
    # sep_token: vLLM's processor appends it to a text-only prompt (chat mode), as the hub tokenizer does.
    fast = save_fast_tokenizer(tok, out, bos="<s>", eos="</s>", pad="<pad>", unk="<unk>",
                               extra={"sep_token": "<reserved08706>"})
    config = ChameleonConfig(
        vocab_size=len(fast), **TEXT, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        # 512-px images, 4 downsamplings -> 32 x 32 = 1024 image tokens, as the real VQ-VAE.
        vq_config=dict(embed_dim=32, num_embeddings=codes, latent_channels=32, resolution=512, base_channels=32,
                       channel_multiplier=[1, 1, 2, 2, 4], num_res_blocks=1, attn_resolutions=[]),
        vocabulary_map=fast.get_vocab(), image_token_id=fast.convert_tokens_to_ids("<image>"),
    )
    ChameleonForConditionalGeneration(config).eval().save_pretrained(out)
    ChameleonProcessor(image_processor=ChameleonImageProcessor(), tokenizer=fast,
                       image_seq_length=1024).save_pretrained(out)
    return _finish(out)


# --- Llama 4 (meta-llama/Llama-4-Scout-17B-16E-Instruct): MoE LM, 336-px chunks, chat template -------

LLAMA4_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>",
                   "<|eom|>", "<|finetune_right_pad|>", "<|python_start|>", "<|python_end|>", "<|image_start|>",
                   "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>"]


def build_tiny_llama4(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if _done(out):
        return out
    import torch
    from transformers import (Llama4Config, Llama4ForConditionalGeneration, Llama4ImageProcessorFast,
                              Llama4Processor)
    from transformers.models.llama4.processing_llama4 import chat_template  # the hub model's template

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    fast = save_fast_tokenizer(train_tokenizer(LLAMA4_SPECIALS), out, bos="<|begin_of_text|>", eos="<|eot|>",
                               pad="<|finetune_right_pad|>", extra={"chat_template": chat_template})
    ids = {t: fast.convert_tokens_to_ids(t) for t in LLAMA4_SPECIALS}
    config = Llama4Config(
        # 336-px chunks, patch 14 (24 x 24), pixel shuffle 0.5 -> 144 tokens per chunk, as Scout. The
        # shuffle multiplies the width by 4 (hidden 64 -> intermediate 256), as 1408 -> 5632 there.
        vision_config=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=1, num_attention_heads=1,
                           image_size=336, patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=128,
                           projector_output_dim=128, vision_output_dim=128),
        text_config=dict(vocab_size=len(fast), hidden_size=128, intermediate_size=128, intermediate_size_mlp=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=1,
                         max_position_embeddings=16384, attention_chunk_size=8192,
                         bos_token_id=ids["<|begin_of_text|>"],
                         eos_token_id=[ids["<|end_of_text|>"], ids["<|eom|>"], ids["<|eot|>"]],
                         pad_token_id=ids["<|finetune_right_pad|>"]),
        boi_token_index=ids["<|image_start|>"], eoi_token_index=ids["<|image_end|>"],
        image_token_index=ids["<|image|>"],
    )
    Llama4ForConditionalGeneration(config).eval().save_pretrained(out)
    Llama4Processor(image_processor=Llama4ImageProcessorFast(size={"height": 336, "width": 336}, max_patches=16),
                    tokenizer=fast, patch_size=14, pixel_shuffle_ratio=0.5,
                    chat_template=chat_template).save_pretrained(out)
    return _finish(out)


# --- Architectures vLLM 0.26 dropped --------------------------------------------------------------

def build_tiny_mllama(out: Path, seed: int = 0) -> Path:
    """Llama 3.2 Vision: an encoder-decoder model, removed with vLLM's V0 engine."""
    _removed_from_vllm("MllamaForConditionalGeneration")
    raise NotImplementedError("no tiny Mllama builder: vLLM implements MllamaForConditionalGeneration again")


def build_tiny_fuyu(out: Path, seed: int = 0) -> Path:
    _removed_from_vllm("FuyuForCausalLM")
    raise NotImplementedError("no tiny Fuyu builder: vLLM implements FuyuForCausalLM again")


# --- Gemma 3n (google/gemma-3n-E2B-it): MobileNetV5 tower (timm), audio tower, AltUp LM ---------------

GEMMA3N_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                    "<start_of_audio>"]
# Gemma 3n embeds its media tokens with separate tables placed after the text vocabulary: 128 vision
# ids (from <end_of_image>, then <image_soft_token>) and 128 audio ids (<end_of_audio>, <audio_soft_token>).
MEDIA_VOCAB = 128


def build_tiny_gemma3n(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if _done(out):
        return out
    import torch
    from tokenizers import AddedToken
    from transformers import (Gemma3nAudioFeatureExtractor, Gemma3nConfig, Gemma3nForConditionalGeneration,
                              Gemma3nProcessor, SiglipImageProcessor)

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(GEMMA3N_SPECIALS)
    # Gemma's vocabulary has runs of newlines as single tokens; vLLM's Gemma 3n processor merges them.
    tok.add_tokens([AddedToken("\n" * n, normalized=False) for n in (1, 2, 3, 4)])
    text_vocab = tok.get_vocab_size()

    def table(first: str, soft: str, kind: str) -> list:
        return [first, soft, *(f"<{kind}_reserved_{i}>" for i in range(MEDIA_VOCAB - 2))]

    media = table("<end_of_image>", "<image_soft_token>", "vision") + table("<end_of_audio>", "<audio_soft_token>", "audio")
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in media])
    fast = save_fast_tokenizer(tok, out, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", extra={
        "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                 "image_token": "<image_soft_token>", "boa_token": "<start_of_audio>",
                                 "eoa_token": "<end_of_audio>", "audio_token": "<audio_soft_token>"}})
    ids = {t: fast.convert_tokens_to_ids(t) for t in GEMMA3N_SPECIALS + media[:2] + media[MEDIA_VOCAB:MEDIA_VOCAB + 2]}
    assert ids["<end_of_image>"] == text_vocab and ids["<end_of_audio>"] == text_vocab + MEDIA_VOCAB
    config = Gemma3nConfig(
        text_config=dict(vocab_size=len(fast), vocab_size_per_layer_input=text_vocab, hidden_size=128,
                         hidden_size_per_layer_input=16, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                         sliding_window=512, layer_types=["sliding_attention", "full_attention"],
                         num_kv_shared_layers=0, laurel_rank=8, activation_sparsity_pattern=[0.0, 0.0],
                         bos_token_id=ids["<bos>"], eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]],
                         pad_token_id=ids["<pad>"]),
        # The real encoder (timm mobilenetv5_300m_enc) at 1/8 of its channels (~16M parameters, not 300M),
        # fusing on the real 16 x 16 grid: 256 soft tokens per 768-px image, as vLLM's Gemma 3n processor
        # assumes. timm's MobileNetV5Encoder hard-codes its fusion adapter's output at 2048 channels (it
        # filters out a `num_features` kwarg), and vLLM and transformers reshape the tower's output with
        # vision_config.hidden_size, so hidden_size must stay 2048.
        vision_config=dict(model_args={"channel_multiplier": 0.125}, hidden_size=2048,
                           vocab_size=MEDIA_VOCAB, vocab_offset=text_vocab),
        audio_config=dict(vocab_size=MEDIA_VOCAB, vocab_offset=text_vocab + MEDIA_VOCAB, hidden_size=64,
                          conf_num_attention_heads=1, conf_num_hidden_layers=1, sscp_conv_channel_size=[16, 8]),
        boi_token_id=ids["<start_of_image>"], eoi_token_id=ids["<end_of_image>"],
        image_token_id=ids["<image_soft_token>"], boa_token_id=ids["<start_of_audio>"],
        eoa_token_id=ids["<end_of_audio>"], audio_token_id=ids["<audio_soft_token>"],
    )
    Gemma3nForConditionalGeneration(config).eval().save_pretrained(out)
    Gemma3nProcessor(feature_extractor=Gemma3nAudioFeatureExtractor(),
                     image_processor=SiglipImageProcessor(size={"height": 768, "width": 768}, image_mean=[0.0] * 3,
                                                          image_std=[1.0] * 3),
                     tokenizer=fast, image_seq_length=256, audio_seq_length=188).save_pretrained(out)
    return _finish(out)
