"""A tiny random-weight checkpoint for Llama-3.1-Nemotron-Nano-VL (nvidia/Llama-3.1-Nemotron-Nano-VL-8B-V1;
recipe nemotron_vl).

vLLM 0.26 implements the model (nemotron_vl.py: LlamaNemotronVLChatModel) and builds its processor itself
(processors/nemotron_vl.py: InternVL-style tiles, `<img>` + `<image>` per tile token + `</img>`), but takes
three things from the checkpoint's own code, each written here by us, minimal, never the hub repo's:
- the config class (model_type Llama_Nemotron_Nano_VL): ours, tests/tiny_remote_common.py, with the fields
  vLLM reads (force_image_size, downsample_ratio, ps_version, vit_hidden_size, projector_hidden_size);
- the image processor (cached_image_processor_from_config), of which vLLM reads only `image_size`,
  `max_num_tiles` and `use_thumbnail` and then tiles the image itself: IMAGE_PROCESSOR_SOURCE below holds
  those three;
- the vision tower, which vLLM builds with AutoModel.from_config(config.vision_config, trust_remote_code)
  and calls as `vision_model(x=pixel_values).features` ((tiles, patches, vit_hidden_size)): the hub's is
  C-RADIO (another repo's code); ours is a minimal ViT with that interface (VISION_SOURCE below), named
  by the vision config's own `auto_map` (as the hub's names C-RADIO's) and found in the checkpoint's folder.
The LM is Llama 3.1's layout with Llama 3's chat format; tiles are 128 px of 16-px patches, 64 patches and
16 tokens a tile after the 0.5 pixel shuffle (the real model: 512 px, 256 tokens), up to 12 tiles and a
thumbnail as the real model's image processor config says.
"""

from __future__ import annotations

from pathlib import Path

from tests.tiny_remote_common import (TEXT, done, finish, layernorm, linear, llama_lm_shapes, save_random,
                                      text_config, tokenizer, write_json, write_remote_config)

TILE, PATCH = 128, 16
NEMOTRON_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                     "<|eot_id|>", "<img>", "</img>", "<image>", "<|finetune_right_pad_id|>"]
# Llama 3's turns (the real checkpoint's template is Llama 3.1's; the recipe sends a user turn only).
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
VISION = dict(model_type="tiny_nemotron_vit", auto_map={"AutoModel": "modeling_tiny.TinyViTModel"}, hidden_size=64,
              intermediate_size=128, num_hidden_layers=2, num_attention_heads=1, image_size=TILE, patch_size=PATCH)
IMAGE = dict(image_size=TILE, max_num_tiles=12, use_thumbnail=True)

IMAGE_PROCESSOR_SOURCE = '''"""A minimal image processor for a tiny random-weight test checkpoint (vlm-caption
tests/tiny_remote_nemotron.py). Not the model repository's code: vLLM 0.26's nemotron_vl.py reads only
these three values from it and tiles the image with its own LlamaNemotronNanoVLImageProcessor."""

from transformers.image_processing_utils import BaseImageProcessor


class TinyNemotronImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values"]

    def __init__(self, image_size=512, max_num_tiles=12, use_thumbnail=True, **kwargs):
        super().__init__(**kwargs)
        self.image_size, self.max_num_tiles, self.use_thumbnail = image_size, max_num_tiles, use_thumbnail
'''

VISION_SOURCE = '''"""A minimal ViT for a tiny random-weight test checkpoint (vlm-caption tests/tiny_remote_nemotron.py).

Not the model repository's code (whose tower is C-RADIO): only the interface vLLM 0.26's nemotron_vl.py
uses, AutoModel.from_config(vision_config) and `model(x=pixel_values).features` -> (images, patches, width)."""

from types import SimpleNamespace

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class TinyViTBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        width, self.heads = config.hidden_size, config.num_attention_heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, config.intermediate_size), nn.Linear(config.intermediate_size, width)

    def forward(self, x):
        b, n, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, width))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class TinyViTModel(PreTrainedModel):
    config_class = PretrainedConfig

    def __init__(self, config):
        super().__init__(config)
        width, patch = config.hidden_size, config.patch_size
        self.patch_embed = nn.Conv2d(3, width, patch, patch)
        self.pos_embed = nn.Parameter(torch.zeros(1, (config.image_size // patch) ** 2, width))
        self.blocks = nn.ModuleList(TinyViTBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(width)
        self.post_init()

    def forward(self, x):
        x = self.patch_embed(x.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return SimpleNamespace(features=self.norm(x))
'''


def _vision_shapes(shapes: dict, prefix: str = "vision_model.") -> None:
    """The names of VISION_SOURCE's TinyViTModel."""
    width, inter, patch = VISION["hidden_size"], VISION["intermediate_size"], VISION["patch_size"]
    shapes[prefix + "patch_embed.weight"] = (width, 3, patch, patch)
    shapes[prefix + "patch_embed.bias"] = (width,)
    shapes[prefix + "pos_embed"] = (1, (VISION["image_size"] // patch) ** 2, width)
    for i in range(VISION["num_hidden_layers"]):
        block = f"{prefix}blocks.{i}."
        layernorm(shapes, block + "norm1", width)
        layernorm(shapes, block + "norm2", width)
        linear(shapes, block + "qkv", 3 * width, width, bias=True)
        linear(shapes, block + "proj", width, width, bias=True)
        linear(shapes, block + "fc1", inter, width, bias=True)
        linear(shapes, block + "fc2", width, inter, bias=True)
    layernorm(shapes, prefix + "norm", width)


def build_tiny_nemotron_vl(out: Path, seed: int = 0) -> Path:
    out = Path(out)
    if done(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    bos, eos = "<|begin_of_text|>", "<|eot_id|>"
    fast, ids = tokenizer(out, NEMOTRON_SPECIALS, bos=bos, eos=eos, pad="<|finetune_right_pad_id|>",
                          chat_template=LLAMA3_CHAT_TEMPLATE)
    llm = text_config(fast, ids, "llama", "LlamaForCausalLM", eos=eos, bos=bos)
    projector = TEXT["intermediate_size"]
    (out / "modeling_tiny.py").write_text(VISION_SOURCE)
    write_remote_config(out, dict(model_type="Llama_Nemotron_Nano_VL", architectures=["Llama_Nemotron_Nano_VL"],
                                  vision_config=VISION, llm_config=llm, force_image_size=TILE, downsample_ratio=0.5,
                                  ps_version="v2", vit_hidden_size=VISION["hidden_size"],
                                  projector_hidden_size=projector, img_context_token_id=ids["<image>"],
                                  template="llama3-chat", torch_dtype="bfloat16"),
                        {"vision_config": None, "llm_config": "llama"})
    (out / "image_processing_tiny.py").write_text(IMAGE_PROCESSOR_SOURCE)
    write_json(out / "preprocessor_config.json", dict(
        IMAGE, image_processor_type="TinyNemotronImageProcessor",
        auto_map={"AutoImageProcessor": "image_processing_tiny.TinyNemotronImageProcessor"}))
    shapes: dict = {}
    _vision_shapes(shapes)
    merged = VISION["hidden_size"] * 4  # 2x2 patches after the 0.5 pixel shuffle
    layernorm(shapes, "mlp1.0", merged)
    linear(shapes, "mlp1.1", projector, merged, bias=True)
    linear(shapes, "mlp1.3", TEXT["hidden_size"], projector, bias=True)
    llama_lm_shapes(shapes, "language_model.", len(fast))
    save_random(out, shapes, seed)
    return finish(out)
