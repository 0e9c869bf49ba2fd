"""A tiny random-weight checkpoint for Keye-VL (Kwai-Keye/Keye-VL-8B-Preview; recipe keye_vl).

vLLM 0.26 implements KeyeForConditionalGeneration (keye.py: a SigLIP tower fed 14-px patches with
packed positions, a 2x2-merging projector `mlp_AR`, a Qwen3 LM with M-RoPE) but takes the config
class and the processor from the checkpoint: the hub repo's are its own code. Here the config is
ours (a Qwen3 config with a vision_config, tests/tiny_remote_common.py) and so is the processor
(PROCESSOR_SOURCE, auto_map), written from what vLLM's keye.py reads and expects of it: `size`
with min_pixels / max_pixels, `merge_size`, Qwen2-VL's smart resize to whole 28-px groups, patches
as (N, 3, 14, 14) with (t, h, w) grids (one frame per temporal step), and the text's
`<|image_pad|>` / `<|video_pad|>` repeated once per 2x2 group. Not the hub repo's code.
"""

from __future__ import annotations

from pathlib import Path

from tests.tiny_remote_common import (TEXT, chatml_template, done, finish, layernorm, linear, llama_lm_shapes,
                                      save_random, siglip_tower_shapes, text_config, tokenizer, write_json,
                                      write_remote_config)

KEYE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>", "<think>", "</think>"]
KEYE_VISION = dict(model_type="siglip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=1, num_channels=3, image_size=112, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=1, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                   attention_dropout=0.0)
KEYE_IMAGE = dict(patch_size=14, merge_size=2, temporal_patch_size=1, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
                  image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])

PROCESSOR_SOURCE = '''"""A minimal Keye-VL-style processor for a tiny random-weight test checkpoint (vlm-caption
tests/tiny_remote_keye.py). Not the model repository's code."""

import numpy as np
import torch
from PIL import Image
from transformers import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
from transformers.processing_utils import ProcessorMixin


class TinyKeyeImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "image_grid_thw"]

    def __init__(self, patch_size=14, merge_size=2, temporal_patch_size=1, min_pixels=3136, max_pixels=1003520,
                 image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), size=None, per_frame=False, **kwargs):
        super().__init__(**kwargs)
        self.per_frame = per_frame
        self.patch_size, self.merge_size, self.temporal_patch_size = patch_size, merge_size, temporal_patch_size
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.size = {"min_pixels": min_pixels, "max_pixels": max_pixels}
        self.image_mean, self.image_std = list(image_mean), list(image_std)

    def _frames(self, frames):
        frames = [Image.fromarray(np.asarray(f, dtype=np.uint8)) if not isinstance(f, Image.Image) else f
                  for f in frames]
        width, height = frames[0].size
        p = self.patch_size
        new_h, new_w = smart_resize(height, width, factor=p * self.merge_size, min_pixels=self.min_pixels,
                                    max_pixels=self.max_pixels)
        out = []
        for frame in frames:
            pixels = np.asarray(frame.convert("RGB").resize((new_w, new_h)), dtype=np.float32) / 255.0
            pixels = (pixels - np.array(self.image_mean, np.float32)) / np.array(self.image_std, np.float32)
            gh, gw = new_h // p, new_w // p
            out.append(torch.from_numpy(pixels).reshape(gh, p, gw, p, 3).permute(0, 2, 4, 1, 3)
                       .reshape(gh * gw, 3, p, p))
        return torch.cat(out), (len(frames), new_h // p, new_w // p)

    def preprocess(self, images=None, videos=None, return_tensors=None, **kwargs):
        result = {}
        if images is not None:
            images = images if isinstance(images, (list, tuple)) else [images]
            done = [self._frames([image]) for image in images]
            result["pixel_values"] = torch.cat([patches for patches, _ in done])
            result["image_grid_thw"] = torch.tensor([grid for _, grid in done])
        if videos is not None:
            done = [self._frames(list(video)) for video in videos]
            result["pixel_values_videos"] = torch.cat([patches for patches, _ in done])
            result["video_grid_thw"] = torch.tensor([grid for _, grid in done])
        return BatchFeature(result)


class TinyKeyeProcessor(ProcessorMixin):
    attributes = ["image_processor", "tokenizer"]
    image_processor_class = "AutoImageProcessor"
    tokenizer_class = "AutoTokenizer"
    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"
    frame_token, fast_start, fast_end = "<|frame|>", "<|fast_start|>", "<|fast_end|>"

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        self._frames_text = []
        features = dict(self.image_processor.preprocess(images=images or None, videos=videos or None))
        merge = self.image_processor.merge_size ** 2
        counts = {token: [int(g.prod()) // merge for g in features.get(key, [])]
                  for token, key in ((self.image_token, "image_grid_thw"), (self.video_token, "video_grid_thw"))}
        if self.image_processor.per_frame and "video_grid_thw" in features:
            # Keye-VL-1.5: one (1, h, w) row a frame, each frame's tokens after a frame token
            grids = [row for grid in features["video_grid_thw"].tolist() for row in [[1, grid[1], grid[2]]] * grid[0]]
            features["num_frames"] = torch.tensor([grid[0] for grid in features["video_grid_thw"].tolist()])
            features["video_grid_thw"] = torch.tensor(grids)
            counts[self.video_token] = []
            self._frames_text = ["".join(self.frame_token + "\\1" * (h * w // merge) for _, h, w in grids)]
        texts = [text] if isinstance(text, str) else list(text or [])
        expanded = []
        for piece in texts:
            for token, numbers in counts.items():
                parts = piece.split(token)
                piece = parts[0] + "".join("\\0" * (numbers.pop(0) if numbers else 1) + part for part in parts[1:])
                piece = piece.replace("\\0", token)
            if self._frames_text:
                parts = piece.split(self.video_token)
                piece = parts[0] + "".join(self._frames_text.pop(0) + part for part in parts[1:])
                piece = piece.replace("\\1", self.video_token)
            expanded.append(piece)
        if expanded:
            features.update(self.tokenizer(expanded, return_tensors="pt", add_special_tokens=False))
        return BatchFeature(features)
'''


def build_tiny_keye_vl(out: Path, seed: int = 0) -> Path:
    return _build(out, seed, "Keye", "KeyeForConditionalGeneration")


def build_tiny_keye_vl1_5(out: Path, seed: int = 0) -> Path:
    """Keye-VL-1.5 (keye_vl1_5.py): the projector's LayerNorm over the merged 2x2 features; a video's
    frames each a (1, h, w) grid after a frame token, `num_frames` per video."""
    return _build(out, seed, "KeyeVL1_5", "KeyeVL1_5ForConditionalGeneration", v1_5=True)


def _build(out: Path, seed: int, model_type: str, architecture: str, v1_5: bool = False) -> Path:
    out = Path(out)
    if done(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    specials = KEYE_SPECIALS + (["<|frame|>", "<|fast_start|>", "<|fast_end|>"] if v1_5 else [])
    fast, ids = tokenizer(out, specials, eos="<|im_end|>", pad="<|endoftext|>", chat_template=chatml_template())
    text = text_config(fast, ids, "qwen3", "Qwen3ForCausalLM", eos="<|im_end|>")
    # M-RoPE over the 64-wide heads: 32 rotary pairs split (t, h, w) as Qwen-VL's 16/24/24 of 64.
    text["rope_scaling"] = {"type": "mrope", "rope_type": "default", "mrope_section": [8, 12, 12]}
    write_remote_config(out, dict(text, model_type=model_type, architectures=[architecture],
                                  vision_config=KEYE_VISION, image_token_id=ids["<|image_pad|>"],
                                  video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"]),
                        {"vision_config": None}, base="qwen3", class_name="KeyeConfig")
    (out / "processing_tiny.py").write_text(PROCESSOR_SOURCE)
    auto_map = {"AutoImageProcessor": "processing_tiny.TinyKeyeImageProcessor",
                "AutoProcessor": "processing_tiny.TinyKeyeProcessor"}
    write_json(out / "preprocessor_config.json", dict(KEYE_IMAGE, per_frame=v1_5, image_processor_type="TinyKeyeImageProcessor",
                                                      processor_class="TinyKeyeProcessor", auto_map=auto_map))
    write_json(out / "processor_config.json", dict(processor_class="TinyKeyeProcessor",
                                                   auto_map={"AutoProcessor": auto_map["AutoProcessor"]}))
    v = KEYE_VISION
    e = v["hidden_size"]
    shapes: dict = {}
    vm = "visual.vision_model."
    siglip_tower_shapes(shapes, vm, v, packing=True)
    layernorm(shapes, "mlp_AR.pre_norm", 4 * e if v1_5 else e)
    linear(shapes, "mlp_AR.linear_1", 4 * e, 4 * e, bias=True)
    linear(shapes, "mlp_AR.linear_2", TEXT["hidden_size"], 4 * e, bias=True)
    llama_lm_shapes(shapes, "", len(fast))
    for i in range(TEXT["num_hidden_layers"]):  # Qwen3's per-head q/k norms
        layernorm(shapes, f"model.layers.{i}.self_attn.q_norm", TEXT["head_dim"], bias=False)
        layernorm(shapes, f"model.layers.{i}.self_attn.k_norm", TEXT["head_dim"], bias=False)
    save_random(out, shapes, seed)
    return finish(out)
