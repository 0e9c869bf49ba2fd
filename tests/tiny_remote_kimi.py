"""A tiny random-weight checkpoint for Kimi-VL (moonshotai/Kimi-VL-A3B-Instruct; recipe kimi_vl).

vLLM 0.26 registers KimiVLConfig (configs/kimi_vl.py: a MoonViT tower, a DeepSeek-V2-style LM) and
implements the model, but takes the processor from the checkpoint (AutoProcessor): the hub repo's
KimiVLProcessor / KimiVLImageProcessor are its own code. The checkpoint carries our own minimal
processor instead (PROCESSOR_SOURCE below, written from vLLM's description of it in kimi_vl.py's
`get_num_image_tokens`, not from the hub's files): an image larger than `in_token_limit` patches
is scaled down, padded to whole 2x2 groups of 14-px patches and cut into patches; the text's
`<|media_pad|>` becomes one token per 2x2 group. The LM is DeepSeek-V2's MLA attention at the
real latent widths (kv_lora_rank 512, rope 64) and tiny everything else, dense layers only.
"""

from __future__ import annotations

from pathlib import Path

from tests.tiny_remote_common import (TEXT, done, finish, layernorm, linear, save_random, tokenizer,
                                      write_json)

KIMI_SPECIALS = ["[BOS]", "[EOS]", "[PAD]", "[UNK]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                 "<|im_system|>", "<|im_middle|>", "<|media_start|>", "<|media_content|>", "<|media_end|>",
                 "<|media_pad|>"]
KIMI_VISION = dict(model_type="moonvit", patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8,
                   num_attention_heads=1, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                   merge_kernel_size=[2, 2])
MLA = dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
IMAGE = dict(patch_size=14, merge_kernel_size=[2, 2], in_token_limit=4096, image_mean=[0.5, 0.5, 0.5],
             image_std=[0.5, 0.5, 0.5])

PROCESSOR_SOURCE = '''"""A minimal Kimi-VL-style processor for a tiny random-weight test checkpoint (vlm-caption
tests/tiny_remote_kimi.py). Not the model repository's code."""

import math

import numpy as np
import torch
from transformers import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor
from transformers.processing_utils import ProcessorMixin


class TinyKimiVLImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "image_grid_hws"]

    def __init__(self, patch_size=14, merge_kernel_size=(2, 2), in_token_limit=4096, image_mean=(0.5, 0.5, 0.5),
                 image_std=(0.5, 0.5, 0.5), **kwargs):
        super().__init__(**kwargs)
        self.patch_size, self.merge_kernel_size = patch_size, list(merge_kernel_size)
        self.in_token_limit, self.image_mean, self.image_std = in_token_limit, list(image_mean), list(image_std)

    def _patches(self, image):
        image = image.convert("RGB")
        width, height = image.size
        p = self.patch_size
        if (width // p) * (height // p) > self.in_token_limit:
            scale = math.sqrt(self.in_token_limit / ((width // p) * (height // p)))
            width, height = int(width * scale), int(height * scale)
            image = image.resize((width, height))
        kh, kw = self.merge_kernel_size
        padded_h = height + (kh * p - height % (kh * p)) % (kh * p)
        padded_w = width + (kw * p - width % (kw * p)) % (kw * p)
        pixels = np.zeros((padded_h, padded_w, 3), dtype=np.float32)
        pixels[:height, :width] = np.asarray(image, dtype=np.float32) / 255.0
        pixels = (pixels - np.array(self.image_mean, dtype=np.float32)) / np.array(self.image_std, dtype=np.float32)
        gh, gw = padded_h // p, padded_w // p
        patches = torch.from_numpy(pixels).reshape(gh, p, gw, p, 3).permute(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
        return patches, (gh, gw)

    def preprocess(self, images, return_tensors=None, **kwargs):
        images = images if isinstance(images, (list, tuple)) else [images]
        done = [self._patches(image) for image in images]
        return BatchFeature({"pixel_values": torch.cat([patches for patches, _ in done]),
                             "image_grid_hws": torch.tensor([grid for _, grid in done])})


class TinyKimiVLProcessor(ProcessorMixin):
    attributes = ["image_processor", "tokenizer"]
    image_processor_class = "AutoImageProcessor"
    tokenizer_class = "AutoTokenizer"
    image_token = "<|media_pad|>"

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    def __call__(self, images=None, text=None, **kwargs):
        kwargs.pop("return_tensors", None)
        features = {}
        counts = []
        if images is not None:
            features = dict(self.image_processor.preprocess(images))
            kh, kw = self.image_processor.merge_kernel_size
            counts = [int(h * w) // (kh * kw) for h, w in features["image_grid_hws"].tolist()]
        texts = [text] if isinstance(text, str) else list(text or [])
        expanded = []
        for piece in texts:
            parts = piece.split(self.image_token)
            out = parts[0]
            for part in parts[1:]:
                out += self.image_token * (counts.pop(0) if counts else 1) + part  # text alone: unexpanded
            expanded.append(out)
        if expanded:
            features.update(self.tokenizer(expanded, return_tensors="pt", add_special_tokens=False))
        return BatchFeature(features)
'''


def build_tiny_kimi_vl(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if done(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    fast, ids = tokenizer(out, KIMI_SPECIALS, bos="[BOS]", eos="[EOS]", pad="[PAD]")
    h, inter, heads = TEXT["hidden_size"], TEXT["intermediate_size"], TEXT["num_attention_heads"]
    n_layers = TEXT["num_hidden_layers"]
    text = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=len(fast),
                hidden_size=h, intermediate_size=inter, num_hidden_layers=n_layers, num_attention_heads=heads,
                num_key_value_heads=heads, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=800000.0,
                hidden_act="silu", tie_word_embeddings=False, bos_token_id=ids["[BOS]"], eos_token_id=ids["[EOS]"],
                pad_token_id=ids["[PAD]"], first_k_dense_replace=n_layers, n_routed_experts=4,
                torch_dtype="bfloat16", **MLA)
    write_json(out / "config.json", dict(
        model_type="kimi_vl", architectures=["KimiVLForConditionalGeneration"], vision_config=KIMI_VISION,
        text_config=text, media_placeholder_token_id=ids["<|media_pad|>"], pad_token_id=ids["[PAD]"],
        ignore_index=-100, torch_dtype="bfloat16"))
    (out / "processing_tiny.py").write_text(PROCESSOR_SOURCE)
    auto_map = {"AutoImageProcessor": "processing_tiny.TinyKimiVLImageProcessor",
                "AutoProcessor": "processing_tiny.TinyKimiVLProcessor"}
    write_json(out / "preprocessor_config.json", dict(IMAGE, image_processor_type="TinyKimiVLImageProcessor",
                                                      processor_class="TinyKimiVLProcessor", auto_map=auto_map))
    write_json(out / "processor_config.json", dict(processor_class="TinyKimiVLProcessor",
                                                   auto_map={"AutoProcessor": auto_map["AutoProcessor"]}))
    v = KIMI_VISION
    e, p = v["hidden_size"], v["patch_size"]
    shapes: dict = {}
    vt = "vision_tower."
    shapes[vt + "patch_embed.proj.weight"] = (e, 3, p, p)
    shapes[vt + "patch_embed.proj.bias"] = (e,)
    shapes[vt + "patch_embed.pos_emb.weight"] = (v["init_pos_emb_height"], v["init_pos_emb_width"], e)
    for i in range(v["num_hidden_layers"]):
        b = f"{vt}encoder.blocks.{i}."
        layernorm(shapes, b + "norm0", e)
        layernorm(shapes, b + "norm1", e)
        linear(shapes, b + "wqkv", 3 * e, e, bias=True)
        linear(shapes, b + "wo", e, e, bias=True)
        linear(shapes, b + "mlp.fc0", v["intermediate_size"], e, bias=True)
        linear(shapes, b + "mlp.fc1", e, v["intermediate_size"], bias=True)
    layernorm(shapes, vt + "encoder.final_layernorm", e)
    merged = e * 4
    layernorm(shapes, "multi_modal_projector.pre_norm", e)
    linear(shapes, "multi_modal_projector.linear_1", merged, merged, bias=True)
    linear(shapes, "multi_modal_projector.linear_2", h, merged, bias=True)
    lm = "language_model."
    shapes[lm + "model.embed_tokens.weight"] = (len(fast), h)
    qk = MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"]
    for i in range(n_layers):
        layer = f"{lm}model.layers.{i}."
        layernorm(shapes, layer + "input_layernorm", h, bias=False)
        layernorm(shapes, layer + "post_attention_layernorm", h, bias=False)
        linear(shapes, layer + "self_attn.q_proj", heads * qk, h)
        linear(shapes, layer + "self_attn.kv_a_proj_with_mqa", MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"], h)
        layernorm(shapes, layer + "self_attn.kv_a_layernorm", MLA["kv_lora_rank"], bias=False)
        linear(shapes, layer + "self_attn.kv_b_proj", heads * (MLA["qk_nope_head_dim"] + MLA["v_head_dim"]),
               MLA["kv_lora_rank"])
        linear(shapes, layer + "self_attn.o_proj", h, heads * MLA["v_head_dim"])
        linear(shapes, layer + "mlp.gate_proj", inter, h)
        linear(shapes, layer + "mlp.up_proj", inter, h)
        linear(shapes, layer + "mlp.down_proj", h, inter)
    layernorm(shapes, lm + "model.norm", h, bias=False)
    shapes[lm + "lm_head.weight"] = (len(fast), h)
    save_random(out, shapes, seed)
    return finish(out)
