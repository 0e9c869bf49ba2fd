"""Tiny random-weight checkpoints for the Qwen-VL family and GLM-V (which shares its vision tower design).

Qwen3-VL (dense and MoE), the Qwen2.5-Omni thinker, Tarsier2 (Qwen2-VL inside), GLM-4.1V and
GLM-4.5V (bf16 and block-wise FP8). Widths and depths are tiny; the processor configs are the real
models' (patch 14/16, merge 2, the same pixel budgets), so the recipes' `mm_processor_kwargs` mean
what they mean on the real checkpoints. Qwen2-VL / Qwen2.5-VL live in bench/checkpoints.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from vlm_caption.bench.checkpoints import QWEN2_VL_CHAT_TEMPLATE, QWEN2_VL_SPECIALS, build_tiny_qwen_vl
from vlm_caption.tasks.tiny_checkpoint import save_fast_tokenizer, train_tokenizer

MARKER = "TINY_RANDOM_WEIGHTS"
# Text widths every builder shares: vLLM's CPU attention needs head_dim 64 (or 128); 2 layers.
TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=32768)


def _done(out: Path) -> bool:
    """Built: the weights and the marker, which each builder writes last (after any rewrite of the weights)."""
    return (out / "model.safetensors").exists() and (out / MARKER).exists()


def _mark(out: Path) -> Path:
    (out / MARKER).write_text("Random weights: outputs are noise.\n")
    return out


def _tokenizer(out: Path, specials: list[str], *, eos: str, pad: str, chat_template: str | None = None,
               extra: dict | None = None):
    fast = save_fast_tokenizer(train_tokenizer(specials), out, eos=eos, pad=pad,
                               extra={**({"chat_template": chat_template} if chat_template else {}), **(extra or {})})
    return fast, {t: fast.convert_tokens_to_ids(t) for t in specials}


# --- Qwen3-VL -----------------------------------------------------------------------------------
# Qwen3-VL-4B-Instruct's processor: patch 16, merge 2 (32 px per token), its image and video
# pixel budgets and mean/std 0.5. Videos get "<t seconds>" text per frame, hence video metadata.
QWEN3_VL_IMAGE = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                      size={"shortest_edge": 65536, "longest_edge": 16777216})
QWEN3_VL_VIDEO = dict(QWEN3_VL_IMAGE, size={"shortest_edge": 4096, "longest_edge": 25165824})
# The vision tower: deepstack taps layer 0 into the LM; 2304 learned positions (a 48x48 grid,
# interpolated to each image) as the real one has.
QWEN3_VL_VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=1, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=TEXT["hidden_size"],
                       num_position_embeddings=2304, deepstack_visual_indexes=[0])


def _qwen3_vl(out: Path, seed: int, moe: bool) -> Path:
    out = Path(out)
    if _done(out):
        return out
    import torch
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    fast, ids = _tokenizer(out, QWEN2_VL_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>",
                           chat_template=QWEN2_VL_CHAT_TEMPLATE)
    # Interleaved M-RoPE over (t, h, w): the sections sum to head_dim / 2.
    text = dict(TEXT, vocab_size=len(fast), bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [8, 12, 12],
                                 "mrope_interleaved": True})
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if moe:
        from transformers import Qwen3VLMoeConfig as Config, Qwen3VLMoeForConditionalGeneration as Model

        # 4 experts of width 192, 2 per token, every layer sparse (as Qwen3-VL-30B-A3B); 192 so that
        # no expert dimension equals the hidden size (vLLM tells the fused layouts apart by shape).
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=192, decoder_sparse_step=1,
                    mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False)
    else:
        from transformers import Qwen3VLConfig as Config, Qwen3VLForConditionalGeneration as Model
    config = Config(text_config=text, vision_config=QWEN3_VL_VISION, tie_word_embeddings=False, **tokens)
    Model(config).eval().save_pretrained(out, max_shard_size="100GB")  # one model.safetensors
    if moe:
        _experts_to_hub_layout(out / "model.safetensors")
    Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**QWEN3_VL_IMAGE),
                     video_processor=Qwen3VLVideoProcessor(**QWEN3_VL_VIDEO, fps=2, do_sample_frames=True),
                     tokenizer=fast, chat_template=QWEN2_VL_CHAT_TEMPLATE).save_pretrained(out)
    return _mark(out)


def build_tiny_qwen3_vl(out: Path, seed: int = 0) -> Path:
    """Qwen3-VL (Qwen/Qwen3-VL-4B-Instruct's processor): images and videos with timestamps."""
    return _qwen3_vl(out, seed, moe=False)


def build_tiny_qwen3_vl_moe(out: Path, seed: int = 0) -> Path:
    """Qwen3-VL-MoE (Qwen/Qwen3-VL-30B-A3B-Instruct's processor, 4 tiny experts)."""
    return _qwen3_vl(out, seed, moe=True)


def _experts_to_hub_layout(path: Path) -> None:
    """transformers 5 keeps Qwen3-VL-MoE's fused experts as (experts, out, in) and saves them so;
    the hub checkpoint (and what transformers converts on load) is (experts, in, out):
    gate_up_proj (E, hidden, 2 * moe_intermediate), down_proj (E, moe_intermediate, hidden)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


# --- GLM-4.1V / GLM-4.5V -------------------------------------------------------------------------
# GLM-4's tokens in the order the real vocabulary has them (151329 <|endoftext|> ... 151344 <|video|>).
GLM_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
                "<|end_of_video|>", "<|image|>", "<|video|>", "<think>", "</think>"]
# GLM-4.1V-9B-Thinking's processor: patch 14, merge 2, CLIP mean/std; videos sampled at 2 fps
# with a pixel budget across all frames (the recipe's `longest_edge` is that budget).
GLM_IMAGE = dict(patch_size=14, temporal_patch_size=2, merge_size=2,
                 size={"shortest_edge": 12544, "longest_edge": 9633792})
GLM_VIDEO = dict(patch_size=14, temporal_patch_size=2, merge_size=2, fps=2, do_sample_frames=True,
                 size={"shortest_edge": 12544, "longest_edge": 47040000})
# The real chat template's shape: [gMASK]<sop>, <|role|>\n turns, image/video parts as
# begin/end-wrapped single tokens, generation prompt `<|assistant|>`.
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif p['type'] == 'video' %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# image_size 336 / patch 14 as the real tower: its 24x24 learned positions are interpolated.
GLM_VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, image_size=336, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, rms_norm_eps=1e-5)
# GLM-4.5V's LM at a size whose every split works with the recipe's tensor_parallel_size=4 and
# with 128x128 FP8 blocks: 4 heads of 128, 4 experts of 512, one shared expert, layer 0 dense.
GLM_MOE_TEXT = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, head_dim=128, max_position_embeddings=65536, attention_bias=True,
                    moe_intermediate_size=512, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                    first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                    use_qk_norm=False)  # vLLM's GLM-4 MoE reads it; GLM-4.5V's config.json has it


def _glm4v(out: Path, seed: int, moe: bool, fp8: bool = False) -> Path:
    out = Path(out)
    if _done(out):
        return out
    import torch
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    fast, ids = _tokenizer(out, GLM_SPECIALS, eos="<|endoftext|>", pad="<|endoftext|>",
                           chat_template=GLM_CHAT_TEMPLATE)
    # Generation ends at <|endoftext|>, <|user|> or <|observation|>, as the real config says.
    eos = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    # Half the head is rotated (partial_rotary_factor 0.5): M-RoPE sections sum to head_dim / 4.
    if moe:
        from transformers import Glm4vMoeConfig as Config, Glm4vMoeForConditionalGeneration as Model

        text = dict(GLM_MOE_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": [8, 12, 12], "partial_rotary_factor": 0.5})
    else:
        from transformers import Glm4vConfig as Config, Glm4vForConditionalGeneration as Model

        text = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, max_position_embeddings=65536,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6],
                                     "partial_rotary_factor": 0.5})
    text.update(vocab_size=len(fast), eos_token_id=eos, pad_token_id=ids["<|endoftext|>"])
    config = Config(
        text_config=text, vision_config=dict(GLM_VISION, out_hidden_size=text["hidden_size"]),
        image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
    )
    model = Model(config).eval()
    if fp8:
        model = model.to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="100GB")
    if fp8:
        _quantize_fp8_blockwise(out)
    Glm4vProcessor(image_processor=Glm4vImageProcessor(**GLM_IMAGE), video_processor=Glm4vVideoProcessor(**GLM_VIDEO),
                   tokenizer=fast, chat_template=GLM_CHAT_TEMPLATE).save_pretrained(out)
    return _mark(out)


def build_tiny_glm4v(out: Path, seed: int = 0) -> Path:
    """GLM-4.1V (zai-org/GLM-4.1V-9B-Thinking's processor and tokens)."""
    return _glm4v(out, seed, moe=False)


def build_tiny_glm4v_moe(out: Path, seed: int = 0) -> Path:
    """GLM-4.5V (zai-org/GLM-4.5V: the GLM-4.1V tower and processor, a GLM-4.5 MoE LM)."""
    return _glm4v(out, seed, moe=True)


def build_tiny_glm4v_moe_fp8(out: Path, seed: int = 0) -> Path:
    """GLM-4.5V-FP8: the GLM-4.5V checkpoint with the LM's linear layers in 128x128 block FP8."""
    return _glm4v(out, seed, moe=True, fp8=True)


FP8_BLOCK = 128


def _quantize_fp8_blockwise(out: Path) -> None:
    """Store the LM's linear weights as float8_e4m3fn with one `weight_scale_inv` per 128x128 block
    (`quant_method: fp8` with `weight_block_size`, the format vLLM's Fp8LinearMethod / Fp8MoEMethod
    load); the vision tower, router gates, embeddings and lm_head stay bf16 and are listed by full
    module name in `modules_to_not_convert` (vLLM matches those names exactly, after mapping)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors, kept = load_file(str(path)), []
    for name in list(tensors):
        w = tensors[name]
        if name.startswith("model.language_model.layers.") and name.endswith("proj.weight"):
            rows, cols = w.shape[0] // FP8_BLOCK, w.shape[1] // FP8_BLOCK
            if w.shape != (rows * FP8_BLOCK, cols * FP8_BLOCK):
                raise ValueError(f"{name} {tuple(w.shape)} is not made of {FP8_BLOCK}x{FP8_BLOCK} blocks")
            blocks = w.float().reshape(rows, FP8_BLOCK, cols, FP8_BLOCK)
            scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
            tensors[name] = (blocks / scale[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale.float()
        elif name.endswith(".weight") and w.dim() >= 2:
            kept.append(name.removesuffix(".weight"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "modules_to_not_convert": kept}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# --- Qwen2.5-Omni (the thinker; vLLM serves only it) ---------------------------------------------
OMNI_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
                 "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>"]
# The processor finds its tokens as tokenizer attributes, as Qwen2.5-Omni's tokenizer config names them.
OMNI_TOKEN_NAMES = {"image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
                    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
OMNI_CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE.replace("<|vision_start|>", "<|vision_bos|>").replace(
    "<|vision_end|>", "<|vision_eos|>").replace("<|image_pad|>", "<|IMAGE|>").replace("<|video_pad|>", "<|VIDEO|>")
# Qwen2.5-Omni-7B's processor: Qwen2-VL's image/video processing (patch 14, merge 2) and
# Whisper's 128-bin log-mel features for audio.
OMNI_PIXELS = dict(min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2, merge_size=2)


def build_tiny_qwen2_5_omni(out: Path, seed: int = 0) -> Path:
    """Qwen2.5-Omni-7B's layout: config `Qwen2_5OmniModel` with thinker/talker/token2wav sections, the
    thinker's weights under `thinker.` (vLLM loads those and skips `talker.` / `token2wav.`)."""
    out = Path(out)
    if _done(out):
        return out
    import torch
    from transformers import (Qwen2_5OmniConfig, Qwen2_5OmniProcessor, Qwen2_5OmniThinkerForConditionalGeneration,
                              Qwen2VLImageProcessor, Qwen2VLVideoProcessor, WhisperFeatureExtractor)

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    fast, ids = _tokenizer(out, OMNI_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>",
                           chat_template=OMNI_CHAT_TEMPLATE, extra={"extra_special_tokens": OMNI_TOKEN_NAMES})
    text = dict(TEXT, vocab_size=len(fast), bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]})
    text.pop("head_dim")
    thinker = dict(
        text_config=text,
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=1, out_hidden_size=128,
                           fullatt_block_indexes=[1], window_size=112, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=1, encoder_ffn_dim=128,
                          d_model=64, output_dim=128, n_window=100, max_source_positions=1500),
        image_token_index=ids["<|IMAGE|>"], video_token_index=ids["<|VIDEO|>"], audio_token_index=ids["<|AUDIO|>"],
        audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"],
        user_token_id=fast.convert_tokens_to_ids("user") if "user" in fast.get_vocab() else 0,
    )
    # The talker and token2wav speak; vLLM's thinker ignores them, so only their config is written.
    config = Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    config.architectures = ["Qwen2_5OmniModel"]
    model = Qwen2_5OmniThinkerForConditionalGeneration(config.thinker_config).eval()
    model.save_pretrained(out, max_shard_size="100GB")
    _prefix_weights(out / "model.safetensors", "thinker.")
    config.save_pretrained(out)  # over the thinker-only config save_pretrained wrote
    Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(**OMNI_PIXELS), video_processor=Qwen2VLVideoProcessor(**OMNI_PIXELS),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400,
                                                  chunk_length=300, return_attention_mask=True),
        tokenizer=fast, chat_template=OMNI_CHAT_TEMPLATE).save_pretrained(out)
    return _mark(out)


def _prefix_weights(path: Path, prefix: str) -> None:
    from safetensors.torch import load_file, save_file

    save_file({prefix + k: v.contiguous() for k, v in load_file(str(path)).items()}, str(path), metadata={"format": "pt"})


# --- Tarsier2 ------------------------------------------------------------------------------------
def build_tiny_tarsier2(out: Path, seed: int = 0) -> Path:
    """Tarsier2-Recap-7b is Qwen2-VL-7B fine-tuned; its recipe picks vLLM's
    `Tarsier2ForConditionalGeneration` through `hf_overrides`. vLLM 0.26 dropped that class (its
    registry lists it in `_PREVIOUSLY_SUPPORTED_MODELS`: last in v0.23.0), so a check on this Qwen2-VL
    checkpoint records vLLM's own refusal of the architecture the recipe names."""
    return build_tiny_qwen_vl(out, "qwen2_vl", seed=seed)
