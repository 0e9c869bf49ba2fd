"""Tiny random-weight checkpoints for models whose config (and often processor) live in vLLM itself:
DeepSeek-OCR, DeepSeek-VL2, Step3-VL, HunyuanOCR, and Phi-4-multimodal (transformers' format).

transformers has no model classes for most of them, so the weights are written from a table of
(name, shape) in the layout the hub checkpoints use (what vLLM's `load_weights` and
`hf_to_vllm_mapper` read), and config.json is written in the hub's form (vLLM's config classes
read `language_config` etc., which their `to_dict` would not write back). Processor settings,
special tokens and tile sizes are the real models'; only widths and depths are tiny -- except
where vLLM hard-codes a vision tower (DeepSeek-VL2's timm SigLIP-so400m, DeepSeek-OCR's SAM-B +
CLIP-L): those ship at full size, since vLLM builds them regardless of config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from vlm_caption.tasks.tiny_checkpoint import save_fast_tokenizer, train_tokenizer

MARKER = "Random weights: outputs are noise.\n"


# ---------------------------------------------------------------------------------------- helpers
def _done(out: Path) -> bool:
    return (out / "model.safetensors").exists()


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def _save_random(out: Path, shapes: dict[str, tuple[int, ...]], seed: int, dtype: str = "bfloat16") -> None:
    """Random tensors for a {name: shape} table in one safetensors file: norms at 1, the rest small noise."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1 and name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "layrnorm.weight")):
            t = torch.ones(shape)
        elif name.endswith((".bias", "_bias")):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        tensors[name] = t.to(getattr(torch, dtype)).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _linear(shapes: dict, name: str, out_f: int, in_f: int, bias: bool = False) -> None:
    shapes[f"{name}.weight"] = (out_f, in_f)
    if bias:
        shapes[f"{name}.bias"] = (out_f,)


def _layernorm(shapes: dict, name: str, dim: int, bias: bool = True) -> None:
    shapes[f"{name}.weight"] = (dim,)
    if bias:
        shapes[f"{name}.bias"] = (dim,)


def _finish(out: Path) -> Path:
    (out / "TINY_RANDOM_WEIGHTS").write_text(MARKER)
    return out


# --------------------------------------------------------------------------- DeepSeek-VL2 and OCR
# DeepSeek's tokenizer specials (full-width bars) and the ones DeepseekVLV2Processor adds itself.
DEEPSEEK_BOS, DEEPSEEK_EOS, DEEPSEEK_PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
DEEPSEEK_SPECIALS = [DEEPSEEK_BOS, DEEPSEEK_EOS, DEEPSEEK_PAD, "<image>", "<|ref|>", "<|/ref|>", "<|det|>",
                     "<|/det|>", "<|grounding|>", "<|User|>", "<|Assistant|>", "<td>", "</td>"]
# deepseek-vl2-tiny's processor_config.json: 384-px tiles, up to 9 of them, patch 14, 2x2 downsample.
DEEPSEEK_VL2_RESOLUTIONS = [[384, 384], [384, 768], [768, 384], [384, 1152], [1152, 384], [384, 1536],
                            [1536, 384], [768, 768], [384, 1920], [1920, 384], [384, 2304], [2304, 384],
                            [768, 1152], [1152, 768], [384, 2688], [2688, 384], [384, 3072], [3072, 384],
                            [768, 1536], [1536, 768], [384, 3456], [3456, 384], [1152, 1152]]
# A tiny DeepSeek-V2 LM in deepseek-vl2-tiny's form: plain multi-head attention (no MLA: the
# qk/v head dims are 0 and kv_lora_rank null), layer 0 dense, layer 1 MoE with a shared expert.
DEEPSEEK_TEXT = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1,
                     num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                     topk_method="greedy", kv_lora_rank=None, q_lora_rank=None, qk_nope_head_dim=0,
                     qk_rope_head_dim=0, v_head_dim=0, use_mla=False, routed_scaling_factor=1.0,
                     max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6, lm_head=True,
                     rm_head=False, tie_word_embeddings=False, architectures=["DeepseekV2ForCausalLM"],
                     model_type="deepseek_v2", torch_dtype="bfloat16")


def _deepseek_tokenizer(out: Path):
    fast = save_fast_tokenizer(train_tokenizer(DEEPSEEK_SPECIALS), out, bos=DEEPSEEK_BOS, eos=DEEPSEEK_EOS,
                               pad=DEEPSEEK_PAD)
    return fast


def _deepseek_text_shapes(shapes: dict, prefix: str, head_prefix: str, vocab: int) -> None:
    """DeepSeek-V2 LM names as the hub stores them (q/k/v/o and per-expert gate/up/down)."""
    t = DEEPSEEK_TEXT
    h, inter, moe = t["hidden_size"], t["intermediate_size"], t["moe_intermediate_size"]
    shapes[f"{prefix}embed_tokens.weight"] = (vocab, h)
    for i in range(t["num_hidden_layers"]):
        layer = f"{prefix}layers.{i}."
        _layernorm(shapes, layer + "input_layernorm", h, bias=False)
        _layernorm(shapes, layer + "post_attention_layernorm", h, bias=False)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _linear(shapes, layer + "self_attn." + proj, h, h)
        if i < t["first_k_dense_replace"]:
            mlps = {layer + "mlp": inter}
        else:
            shapes[layer + "mlp.gate.weight"] = (t["n_routed_experts"], h)
            mlps = {f"{layer}mlp.experts.{e}": moe for e in range(t["n_routed_experts"])}
            mlps[layer + "mlp.shared_experts"] = moe * t["n_shared_experts"]
        for name, width in mlps.items():
            _linear(shapes, name + ".gate_proj", width, h)
            _linear(shapes, name + ".up_proj", width, h)
            _linear(shapes, name + ".down_proj", h, width)
    _layernorm(shapes, f"{prefix}norm", h, bias=False)
    shapes[f"{head_prefix}lm_head.weight"] = (vocab, h)


def _vit_blocks(shapes: dict, prefix: str, depth: int, width: int, mlp: int, *, fc=("fc1", "fc2"),
                rel_pos: dict[int, int] | None = None) -> None:
    """timm / SAM ViT blocks: norm1, attn.qkv (fused), attn.proj, norm2, mlp.fc1/fc2 (or lin1/lin2)."""
    for i in range(depth):
        b = f"{prefix}blocks.{i}."
        _layernorm(shapes, b + "norm1", width)
        _linear(shapes, b + "attn.qkv", 3 * width, width, bias=True)
        _linear(shapes, b + "attn.proj", width, width, bias=True)
        if rel_pos is not None:
            shapes[b + "attn.rel_pos_h"] = shapes[b + "attn.rel_pos_w"] = (rel_pos[i], width // 12)
        _layernorm(shapes, b + "norm2", width)
        _linear(shapes, b + "mlp." + fc[0], mlp, width, bias=True)
        _linear(shapes, b + "mlp." + fc[1], width, mlp, bias=True)


def _siglip_so400m_shapes(shapes: dict, prefix: str) -> None:
    """timm's vit_so400m_patch14_siglip_384 (vLLM creates exactly this, whatever vision_config says)."""
    w, mlp = 1152, 4304
    shapes[prefix + "pos_embed"] = (1, 729, w)
    shapes[prefix + "patch_embed.proj.weight"] = (w, 3, 14, 14)
    shapes[prefix + "patch_embed.proj.bias"] = (w,)
    _vit_blocks(shapes, prefix, 27, w, mlp)
    _layernorm(shapes, prefix + "norm", w)
    # The MAP head: timm builds it (global_pool="map") and vLLM loads every parameter it has.
    shapes[prefix + "attn_pool.latent"] = (1, 1, w)
    _linear(shapes, prefix + "attn_pool.q", w, w, bias=True)
    _linear(shapes, prefix + "attn_pool.kv", 2 * w, w, bias=True)
    _linear(shapes, prefix + "attn_pool.proj", w, w, bias=True)
    _layernorm(shapes, prefix + "attn_pool.norm", w)
    _linear(shapes, prefix + "attn_pool.mlp.fc1", mlp, w, bias=True)
    _linear(shapes, prefix + "attn_pool.mlp.fc2", w, mlp, bias=True)


def _deepseek_config(fast, *, architecture: str, vision: dict, projector: dict, extra: dict) -> dict:
    text = dict(DEEPSEEK_TEXT, vocab_size=len(fast), bos_token_id=fast.bos_token_id,
                eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    return dict(architectures=[architecture], model_type="deepseek_vl_v2", language_config=text,
                vision_config=vision, projector_config=dict(projector, n_embed=DEEPSEEK_TEXT["hidden_size"]),
                tile_tag="2D", global_view_pos="head", torch_dtype="bfloat16",
                bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, **extra)


def build_tiny_deepseek_vl_v2(out: Path, seed: int = 0) -> Path:
    """deepseek-vl2-tiny's shape: full SigLIP-so400m tower (timm, hard-coded in vLLM), tiny MoE LM.

    vLLM's DeepseekVLV2ForCausalLM imports `timm` to build the tower: the engine needs it installed."""
    out = Path(out)
    if _done(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    fast = _deepseek_tokenizer(out)
    processor = dict(processor_class="DeepseekVLV2Processor", candidate_resolutions=DEEPSEEK_VL2_RESOLUTIONS,
                     patch_size=14, downsample_ratio=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                     normalize=True, image_token="<image>", pad_token=DEEPSEEK_PAD, add_special_token=False,
                     sft_format="deepseek", mask_prompt=False, ignore_id=-100)
    _write_json(out / "processor_config.json", processor)
    config = _deepseek_config(
        fast, architecture="DeepseekVLV2ForCausalLM",
        vision=dict(model_type="vision", model_name="siglip_so400m_patch14_384", layers=27, width=1152,
                    patch_size=14, image_size=384, mlp_ratio=3.7362),
        projector=dict(model_type="mlp_projector", projector_type="downsample_mlp_gelu", input_dim=1152,
                       depth=2, mlp_ratio=1, downsample_ratio=2),
        extra=dict(candidate_resolutions=DEEPSEEK_VL2_RESOLUTIONS))
    _write_json(out / "config.json", config)
    h = DEEPSEEK_TEXT["hidden_size"]
    shapes: dict = {}
    _siglip_so400m_shapes(shapes, "vision.")
    _linear(shapes, "projector.layers.0", h, 1152 * 4, bias=True)
    _linear(shapes, "projector.layers.2", h, h, bias=True)
    shapes["image_newline"] = shapes["view_seperator"] = (h,)  # sic: vLLM's (and DeepSeek's) spelling
    _deepseek_text_shapes(shapes, "language.model.", "language.", len(fast))
    _save_random(out, shapes, seed)
    return _finish(out)


def build_tiny_deepseek_ocr(out: Path, seed: int = 0) -> Path:
    """DeepSeek-OCR's shape: SAM ViT-B + CLIP-L/14 towers at full size (vLLM builds them from code,
    not config.json), a linear projector from their concatenated 2048 features, and a tiny MoE LM.

    vLLM's DeepseekOCRProcessor has its tiling (1024-px base view, 640-px crops) as constants."""
    out = Path(out)
    if _done(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    fast = _deepseek_tokenizer(out)
    _write_json(out / "processor_config.json", dict(
        processor_class="DeepseekOCRProcessor", patch_size=16, downsample_ratio=4, image_mean=[0.5] * 3,
        image_std=[0.5] * 3, normalize=True, image_token="<image>", pad_token=DEEPSEEK_PAD,
        add_special_token=False, sft_format="deepseek", mask_prompt=False, ignore_id=-100))
    config = _deepseek_config(
        fast, architecture="DeepseekOCRForCausalLM",
        vision=dict(model_type="vision", model_name="deeplip_b_l", image_size=1024, patch_size=16, width=1024,
                    layers=24, mlp_ratio=3.7362),
        projector=dict(model_type="mlp_projector", projector_type="linear", input_dim=2048),
        extra=dict(candidate_resolutions=[[1024, 1024]]))
    _write_json(out / "config.json", config)
    h = DEEPSEEK_TEXT["hidden_size"]
    shapes: dict = {}
    # SAM ViT-B (vLLM's deepencoder.build_sam_vit_b): windowed blocks have 14-wide relative
    # positions (2*14-1), global-attention blocks 2, 5, 8, 11 the full 64 (2*64-1).
    sam = "model.sam_model."
    shapes[sam + "pos_embed"] = (1, 64, 64, 768)
    shapes[sam + "patch_embed.proj.weight"] = (768, 3, 16, 16)
    shapes[sam + "patch_embed.proj.bias"] = (768,)
    _vit_blocks(shapes, sam, 12, 768, 3072, fc=("lin1", "lin2"),
                rel_pos={i: 127 if i in (2, 5, 8, 11) else 27 for i in range(12)})
    shapes[sam + "neck.0.weight"] = (256, 768, 1, 1)
    _layernorm(shapes, sam + "neck.1", 256)
    shapes[sam + "neck.2.weight"] = (256, 256, 3, 3)
    _layernorm(shapes, sam + "neck.3", 256)
    shapes[sam + "net_2.weight"] = (512, 256, 3, 3)
    shapes[sam + "net_3.weight"] = (1024, 512, 3, 3)
    # CLIP-L/14 (vLLM's DeepCLIPVisionTransformer, fused qkv_proj as DeepSeek ships it).
    clip = "model.vision_model."
    shapes[clip + "embeddings.class_embedding"] = (1024,)
    shapes[clip + "embeddings.patch_embedding.weight"] = (1024, 3, 14, 14)
    shapes[clip + "embeddings.position_embedding.weight"] = (257, 1024)
    _layernorm(shapes, clip + "pre_layrnorm", 1024)
    for i in range(24):
        layer = f"{clip}transformer.layers.{i}."
        _linear(shapes, layer + "self_attn.qkv_proj", 3072, 1024, bias=True)
        _linear(shapes, layer + "self_attn.out_proj", 1024, 1024, bias=True)
        _layernorm(shapes, layer + "layer_norm1", 1024)
        _linear(shapes, layer + "mlp.fc1", 4096, 1024, bias=True)
        _linear(shapes, layer + "mlp.fc2", 1024, 4096, bias=True)
        _layernorm(shapes, layer + "layer_norm2", 1024)
    _linear(shapes, "model.projector.layers", h, 2048, bias=True)
    shapes["model.image_newline"] = shapes["model.view_seperator"] = (h,)
    _deepseek_text_shapes(shapes, "model.", "", len(fast))
    _save_random(out, shapes, seed)
    return _finish(out)


# ------------------------------------------------------------------------------------- Step3-VL
# Step3's prompt tokens (BOS/EOS with full-width bars, as DeepSeek's) and the image markers
# Step3VLProcessor writes.
STEP3_SPECIALS = [DEEPSEEK_BOS, DEEPSEEK_EOS, "<|BOT|>", "<|EOT|>", "<think>", "</think>",
                  "<im_patch>", "<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>"]
# Step3's vision geometry (vLLM's Step3VLImageProcessor hard-codes 728-px views, 504-px patches,
# 169 / 81 tokens each): patch 14 -> 52x52, a 2x2 stride-2 conv -> 26x26, a 3x3 stride-2 conv -> 13x13.
STEP3_VISION = dict(hidden_size=128, intermediate_size=256, output_hidden_size=64, num_hidden_layers=1,
                    num_attention_heads=2, image_size=728, patch_size=14, hidden_act="quick_gelu")
# Step3's attention: one shared K/V head, Q through a low-rank `share_q_dim` and `wq`; layer 1 MoE.
STEP3_TEXT = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_attention_groups=1,
                  num_hidden_layers=2, head_dim=64, share_q_dim=64, moe_intermediate_size=64, moe_num_experts=4,
                  moe_top_k=2, share_expert_dim=64, moe_layers_enum="1", max_seq_len=8192,
                  max_position_embedding=8192, rope_theta=500000.0)


def build_tiny_step3(out: Path, seed: int = 0) -> Path:
    """stepfun-ai/step3's architecture in bf16 (the real one is FP8 and 321B): Step3VLConfig from vLLM."""
    out = Path(out)
    if _done(out):
        return out
    from vllm.transformers_utils.configs.step3_vl import Step3VLConfig

    out.mkdir(parents=True, exist_ok=True)
    fast = save_fast_tokenizer(train_tokenizer(STEP3_SPECIALS), out, bos=DEEPSEEK_BOS, eos=DEEPSEEK_EOS)
    vocab = len(fast)
    config = Step3VLConfig(vision_config=STEP3_VISION, understand_projector_stride=2, projector_bias=True,
                           # vLLM builds the LM from text_config's own `architectures`.
                           text_config=dict(STEP3_TEXT, vocab_size=vocab, bos_token_id=fast.bos_token_id,
                                            eos_token_id=fast.eos_token_id, architectures=["Step3TextForCausalLM"]),
                           image_token_id=fast.convert_tokens_to_ids("<im_patch>"),
                           architectures=["Step3VLForConditionalGeneration"], torch_dtype="bfloat16",
                           bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    config.save_pretrained(out)
    v, t = STEP3_VISION, STEP3_TEXT
    vw, vo, h = v["hidden_size"], v["output_hidden_size"], t["hidden_size"]
    shapes: dict = {}
    emb = "vision_model.embeddings."
    shapes[emb + "class_embedding"] = (1, vw)
    shapes[emb + "patch_embedding.weight"] = (vw, 3, 14, 14)
    shapes[emb + "patch_embedding.bias"] = (vw,)
    shapes[emb + "position_embedding.weight"] = ((728 // 14) ** 2 + 1, vw)
    for i in range(v["num_hidden_layers"]):
        layer = f"vision_model.transformer.layers.{i}."
        _linear(shapes, layer + "self_attn.qkv_proj", 3 * vw, vw, bias=True)
        _linear(shapes, layer + "self_attn.out_proj", vw, vw, bias=True)
        _layernorm(shapes, layer + "layer_norm1", vw)
        _linear(shapes, layer + "mlp.fc1", v["intermediate_size"], vw, bias=True)
        _linear(shapes, layer + "mlp.fc2", vw, v["intermediate_size"], bias=True)
        _layernorm(shapes, layer + "layer_norm2", vw)
    shapes["vit_downsampler.weight"], shapes["vit_downsampler.bias"] = (vo, vw, 2, 2), (vo,)
    shapes["vit_downsampler2.weight"], shapes["vit_downsampler2.bias"] = (2 * vo, vo, 3, 3), (2 * vo,)
    _linear(shapes, "vit_large_projector", h, 2 * vo, bias=True)
    # The LM as the hub stores it: q/k/v split (vLLM fuses them), routed experts stacked per tensor.
    shapes["model.embed_tokens.weight"] = (vocab, h)
    heads, hd, q = t["num_attention_heads"], t["head_dim"], t["share_q_dim"]
    for i in range(t["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        _layernorm(shapes, layer + "input_layernorm", h, bias=False)
        _layernorm(shapes, layer + "post_attention_layernorm", h, bias=False)
        _linear(shapes, layer + "self_attn.q_proj", q, h)
        _linear(shapes, layer + "self_attn.k_proj", hd, h)
        _linear(shapes, layer + "self_attn.v_proj", hd, h)
        _layernorm(shapes, layer + "self_attn.inter_norm", q, bias=False)
        _linear(shapes, layer + "self_attn.wq", heads * hd, q)
        _linear(shapes, layer + "self_attn.o_proj", h, heads * hd)
        if str(i) in t["moe_layers_enum"].split(","):
            e, m = t["moe_num_experts"], t["moe_intermediate_size"]
            shapes[layer + "moe.gate.weight"] = (e, h)
            shapes[layer + "moe.gate_proj.weight"] = shapes[layer + "moe.up_proj.weight"] = (e, m, h)
            shapes[layer + "moe.down_proj.weight"] = (e, h, m)
            mlp, width = layer + "share_expert", t["share_expert_dim"]
        else:
            mlp, width = layer + "mlp", t["intermediate_size"]
        _linear(shapes, mlp + ".gate_proj", width, h)
        _linear(shapes, mlp + ".up_proj", width, h)
        _linear(shapes, mlp + ".down_proj", h, width)
    _layernorm(shapes, "model.norm", h, bias=False)
    shapes["lm_head.weight"] = (vocab, h)
    _save_random(out, shapes, seed)
    return _finish(out)


# ------------------------------------------------------------------------------------ HunyuanOCR
# HunyuanOCR's tokens (full-width bars): begin / user turn, and the image start, end and pad
# place-holders (100, 101, 102) its processor wraps and expands; 3 is the empty system slot.
def _hy(name: str) -> str:
    return f"<｜hy_{name}｜>"


HY_IMAGE = {"image_start_token": _hy("place▁holder▁no▁100"), "image_end_token": _hy("place▁holder▁no▁101"),
            "image_token": _hy("place▁holder▁no▁102")}
HY_SPECIALS = [_hy("begin▁of▁sentence"), _hy("end▁of▁sentence"), _hy("▁pad▁"), _hy("User"), _hy("Assistant"),
               _hy("place▁holder▁no▁3"), *HY_IMAGE.values(), _hy("place▁holder▁no▁103"),
               _hy("place▁holder▁no▁104"), _hy("place▁holder▁no▁105")]
HY_TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, head_dim=64, max_position_embeddings=8192)
HY_VISION = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                 patch_size=16, spatial_merge_size=2, max_image_size=2048)
# XD-RoPE: 4 sections (text, t, h, w) of half the head dim (32 = 4 x 8 for head_dim 64).
HY_ROPE = {"type": "xdrope", "alpha": 1000.0, "factor": 1.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
           "mscale_all_dim": 1.0, "xdrope_section": [8, 8, 8, 8]}


def build_tiny_hunyuan_vl(out: Path, seed: int = 0) -> Path:
    """HunyuanOCR: weights from transformers' HunYuanVL classes (the hub's `vit.*` / `model.*` names),
    config.json in the hub's flat form that vLLM's own HunYuanVLConfig reads (XD-RoPE `rope_scaling`)."""
    out = Path(out)
    if _done(out):
        return out
    import torch
    from transformers import (
        HunYuanVLConfig,
        HunYuanVLForConditionalGeneration,
        HunYuanVLImageProcessor,
        HunYuanVLProcessor,
    )

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    bos, eos, pad = _hy("begin▁of▁sentence"), _hy("end▁of▁sentence"), _hy("▁pad▁")
    # HunYuanVLProcessor reads the image tokens from the tokenizer's `extra_special_tokens`.
    fast = save_fast_tokenizer(train_tokenizer(HY_SPECIALS), out, bos=bos, eos=eos, pad=pad,
                               extra={"extra_special_tokens": HY_IMAGE})
    ids = {key: fast.convert_tokens_to_ids(tok) for key, tok in HY_IMAGE.items()}
    vocab = len(fast)
    section = HY_ROPE["xdrope_section"]
    hf = HunYuanVLConfig(
        text_config=dict(HY_TEXT, vocab_size=vocab, rope_parameters={
            "rope_type": "xdrope", "rope_theta": 10000.0, "xdrope_section": section, "alpha": 1000.0,
            "factor": 1.0}),
        vision_config=dict(HY_VISION, out_hidden_size=HY_TEXT["hidden_size"], text_hidden_size=HY_TEXT["hidden_size"]))
    model = HunYuanVLForConditionalGeneration(hf).to(torch.bfloat16).eval()
    model.save_pretrained(out, max_shard_size="100GB")
    del model
    config = dict(
        architectures=["HunYuanVLForConditionalGeneration"], model_type="hunyuan_vl", torch_dtype="bfloat16",
        vocab_size=vocab, **HY_TEXT, attention_head_dim=HY_TEXT["head_dim"], use_qk_norm=True, hidden_act="silu",
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=HY_ROPE, tie_word_embeddings=True,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        image_token_id=ids["image_token"], im_start_id=ids["image_start_token"], im_end_id=ids["image_end_token"],
        image_start_token_id=ids["image_start_token"], image_end_token_id=ids["image_end_token"],
        im_newline_id=fast.convert_tokens_to_ids(_hy("place▁holder▁no▁103")),
        video_start_id=fast.convert_tokens_to_ids(_hy("place▁holder▁no▁104")),
        video_end_id=fast.convert_tokens_to_ids(_hy("place▁holder▁no▁105")),
        vision_config=dict(HY_VISION, model_type="hunyuan_vl", hidden_act="gelu", out_hidden_size=HY_TEXT["hidden_size"],
                           text_hidden_size=HY_TEXT["hidden_size"], num_key_value_heads=HY_VISION["num_attention_heads"],
                           temporal_patch_size=1, rms_norm_eps=1e-5, interpolate_mode="bilinear"))
    _write_json(out / "config.json", config)
    HunYuanVLProcessor(image_processor=HunYuanVLImageProcessor(), tokenizer=fast).save_pretrained(out)
    return _finish(out)


# ------------------------------------------------------------------------------- Phi-4-multimodal
# The transformers-format checkpoint (the hub repo's PR #70): vLLM 0.26 dropped its own
# Phi4MultimodalForCausalLM and runs this one through its Transformers backend.
PHI4_SPECIALS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|image|>", "<|audio|>"]
PHI4_TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=8192, original_max_position_embeddings=8192)
# SigLIP-style tower at the real geometry (448-px crops, patch 14); a token-sized audio encoder.
PHI4_VISION = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                   image_size=448, patch_size=14, crop_size=448, feature_layer=-2)
PHI4_AUDIO = dict(hidden_size=64, intermediate_size=128, num_blocks=1, num_attention_heads=1, ext_pw_out_channel=64,
                  depthwise_separable_out_channel=64, nemo_conv_channels=64, left_chunk=18)
# The vision LoRA the recipe loads from `vision-lora/` (rank 8 here; the real one is 256).
PHI4_LORA_TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def build_tiny_phi4_multimodal(out: Path, seed: int = 0) -> Path:
    """Phi-4-multimodal in transformers' format, with a tiny `vision-lora/` adapter.

    vLLM 0.26 cannot serve it multimodally: its own Phi4MultimodalForCausalLM was removed in 0.12
    (registry `_PREVIOUSLY_SUPPORTED_MODELS`), and the Transformers-backend fallback sees a flat
    config (no text_config) and builds a text-only model ("... is not a multimodal model")."""
    out = Path(out)
    if _done(out):
        return out
    import torch
    from transformers import (
        Phi4MultimodalConfig,
        Phi4MultimodalFeatureExtractor,
        Phi4MultimodalForCausalLM,
        Phi4MultimodalImageProcessor,
        Phi4MultimodalProcessor,
    )

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    # Phi4MultimodalProcessor reads the image / audio tokens from the tokenizer's extra specials.
    fast = save_fast_tokenizer(train_tokenizer(PHI4_SPECIALS), out, bos="<|endoftext|>", eos="<|endoftext|>",
                               extra={"extra_special_tokens": {"image_token": "<|image|>", "audio_token": "<|audio|>"}})
    image_id, audio_id = fast.convert_tokens_to_ids("<|image|>"), fast.convert_tokens_to_ids("<|audio|>")
    config = Phi4MultimodalConfig(
        vocab_size=len(fast), **PHI4_TEXT, bos_token_id=fast.bos_token_id, pad_token_id=fast.pad_token_id,
        eos_token_id=[fast.eos_token_id, fast.convert_tokens_to_ids("<|end|>")],
        vision_config=dict(PHI4_VISION, image_token_id=image_id), audio_config=dict(PHI4_AUDIO, audio_token_id=audio_id))
    model = Phi4MultimodalForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(out, max_shard_size="100GB")
    del model
    Phi4MultimodalProcessor(image_processor=Phi4MultimodalImageProcessor(), audio_processor=Phi4MultimodalFeatureExtractor(),
                            tokenizer=fast).save_pretrained(out)
    _save_lora(out / "vision-lora", config, seed)
    return _finish(out)


def _save_lora(folder: Path, config, seed: int, rank: int = 8) -> None:
    """A PEFT LoRA adapter on every LM layer's attention and MLP projections, as the hub's vision-lora."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    h, inter = config.hidden_size, config.intermediate_size
    head = h // config.num_attention_heads
    outs = {"self_attn.qkv_proj": h + 2 * config.num_key_value_heads * head, "self_attn.o_proj": h,
            "mlp.gate_up_proj": 2 * inter, "mlp.down_proj": h}
    ins = {"self_attn.qkv_proj": h, "self_attn.o_proj": h, "mlp.gate_up_proj": h, "mlp.down_proj": inter}
    gen = torch.Generator().manual_seed(seed + 1)
    tensors = {}
    for i in range(config.num_hidden_layers):
        for target in PHI4_LORA_TARGETS:
            base = f"base_model.model.model.layers.{i}.{target}"
            tensors[f"{base}.lora_A.weight"] = (torch.randn(rank, ins[target], generator=gen) * 0.02).to(torch.bfloat16)
            tensors[f"{base}.lora_B.weight"] = torch.zeros(outs[target], rank, dtype=torch.bfloat16)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    _write_json(folder / "adapter_config.json", dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none",
        target_modules=[t.split(".")[-1] for t in PHI4_LORA_TARGETS], base_model_name_or_path=None,
        fan_in_fan_out=False, inference_mode=True))
