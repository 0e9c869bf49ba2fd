"""A tiny random-weight checkpoint for MiniCPM-V 2.6 (openbmb/MiniCPM-V-2_6; recipe minicpmv).

vLLM 0.26 implements MiniCPM-V 2.6 (minicpmv.py: an Idefics2/SigLIP tower over patch strips, the
2.5 resampler, a Qwen2 LM) and vendors MiniCPMVProcessor, but takes the image processor from the
checkpoint's AutoProcessor: the hub's MiniCPMVImageProcessor (slicing) and its config class are
the repo's own code. Here both are ours, minimal and written from what vLLM calls on them
(PROCESSOR_SOURCE; config: tests/tiny_remote_common.py): `get_sliced_grid` picks the (cols, rows)
grid closest to the image's aspect among slice counts around its area in `scale_resolution`
squares; `get_slice_image_placeholder` writes `<image_id>i</image_id>`, the overview's
`<image>` + `<unk>` * query_num + `</image>`, and a `<slice>` group per grid cell, a row a line;
`preprocess` gives each view as a (3, patch, n*patch) strip of row-major patches with its
(rows, cols) patch grid (`tgt_sizes`). Not the hub repo's code.
"""

from __future__ import annotations

from pathlib import Path

from tests.tiny_remote_common import (TEXT, chatml_template, done, finish, layernorm, linear, llama_lm_shapes,
                                      save_random, siglip_tower_shapes, text_config, tokenizer, write_json,
                                      write_remote_config)

MINICPMV_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "<image>", "</image>", "<slice>",
                     "</slice>", "<image_id>", "</image_id>", "<ref>", "</ref>", "<box>", "</box>"]
MINICPMV_VISION = dict(model_type="siglip_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=1, num_channels=3, image_size=112, patch_size=14,
                       hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
QUERY_NUM = 16  # MiniCPM-V 2.6: 64 queries a view
IMAGE = dict(scale_resolution=112, patch_size=14, max_slice_nums=9, image_feature_size=QUERY_NUM,
             image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])

PROCESSOR_SOURCE = '''"""A minimal MiniCPM-V-style image processor for a tiny random-weight test checkpoint (vlm-caption
tests/tiny_remote_minicpm.py). Not the model repository's code."""

import math

import numpy as np
import torch
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.processing_utils import ProcessorMixin


class TinyMiniCPMVImageProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values"]
    im_start_token, im_end_token = "<image>", "</image>"
    slice_start_token, slice_end_token, unk_token = "<slice>", "</slice>", "<unk>"
    im_id_start, im_id_end = "<image_id>", "</image_id>"

    def __init__(self, scale_resolution=448, patch_size=14, max_slice_nums=9, image_feature_size=64,
                 image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), **kwargs):
        super().__init__(**kwargs)
        self.scale_resolution, self.patch_size, self.max_slice_nums = scale_resolution, patch_size, max_slice_nums
        self.image_feature_size = image_feature_size
        self.image_mean, self.image_std = list(image_mean), list(image_std)

    # -- geometry --------------------------------------------------------------------------------
    def _fit(self, width, height, upscale):
        side = self.scale_resolution
        if upscale or width * height > side * side:
            ratio = width / height
            height = int(side / math.sqrt(ratio))
            width = int(height * ratio)
        p = self.patch_size
        return max(round(width / p) * p, p), max(round(height / p) * p, p)

    def get_sliced_grid(self, image_size, max_slice_nums=None, nerver_split=False):
        width, height = image_size
        max_slice_nums = max_slice_nums or self.max_slice_nums
        multiple = min(math.ceil(width * height / self.scale_resolution ** 2), max_slice_nums)
        if multiple <= 1 or nerver_split:
            return None
        candidates = [(cols, count // cols) for count in (multiple - 1, multiple, multiple + 1)
                      if 1 < count <= max_slice_nums for cols in range(1, count + 1) if count % cols == 0]
        aspect = math.log(width / height)
        return list(min(candidates, key=lambda grid: abs(aspect - math.log(grid[0] / grid[1]))))

    def get_slice_image_placeholder(self, image_size, image_idx=0, max_slice_nums=None, use_image_id=True):
        view = self.unk_token * self.image_feature_size
        text = (f"{self.im_id_start}{image_idx}{self.im_id_end}" if use_image_id else "")
        text += self.im_start_token + view + self.im_end_token
        grid = self.get_sliced_grid(image_size, max_slice_nums)
        if grid is not None:
            cols, rows = grid
            text += "\\n".join("".join(self.slice_start_token + view + self.slice_end_token for _ in range(cols))
                              for _ in range(rows))
        return text

    # -- pixels ----------------------------------------------------------------------------------
    def _strip(self, image):
        p = self.patch_size
        pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
        pixels = (pixels - np.array(self.image_mean, np.float32)) / np.array(self.image_std, np.float32)
        tensor = torch.from_numpy(pixels).permute(2, 0, 1)  # (3, H, W)
        rows, cols = tensor.shape[1] // p, tensor.shape[2] // p
        patches = torch.nn.functional.unfold(tensor[None], (p, p), stride=(p, p))  # (1, 3*p*p, rows*cols)
        strip = patches.reshape(3, p, p, rows * cols).permute(0, 1, 3, 2).reshape(3, p, rows * cols * p)
        return strip, (rows, cols)

    def _views(self, image, max_slice_nums):
        width, height = image.size
        views = [image.resize(self._fit(width, height, upscale=False))]
        grid = self.get_sliced_grid((width, height), max_slice_nums)
        if grid is not None:
            cols, rows = grid
            cell_w, cell_h = self._fit(width / cols, height / rows, upscale=True)
            refined = image.resize((cell_w * cols, cell_h * rows))
            views += [refined.crop((c * cell_w, r * cell_h, (c + 1) * cell_w, (r + 1) * cell_h))
                      for r in range(rows) for c in range(cols)]
        return views

    def preprocess(self, images, do_pad=True, max_slice_nums=None, return_tensors=None, **kwargs):
        nested = lambda x: isinstance(x, (list, tuple)) or (isinstance(x, np.ndarray) and x.ndim == 4)  # noqa: E731
        if not isinstance(images, (list, tuple)):
            images = [images]
        # one list of images (or a video's frames) per prompt; a flat list is one prompt's
        images = [list(entry) for entry in images] if any(nested(x) for x in images) else [list(images)]
        pixel_values, image_sizes, tgt_sizes = [], [], []
        for batch in images:
            strips, sizes, grids = [], [], []
            for image in batch:
                if not isinstance(image, Image.Image):  # a video's frames come as arrays
                    image = Image.fromarray(np.asarray(image, dtype=np.uint8))
                sizes.append(image.size)
                for view in self._views(image, max_slice_nums):
                    strip, grid = self._strip(view)
                    strips.append(strip)
                    grids.append(grid)
            pixel_values.append(strips)
            image_sizes.append(sizes)
            tgt_sizes.append(torch.tensor(grids) if grids else torch.zeros((0, 2), dtype=torch.long))
        return BatchFeature({"pixel_values": pixel_values, "image_sizes": image_sizes, "tgt_sizes": tgt_sizes})


class TinyMiniCPMVProcessor(ProcessorMixin):
    """Holds the image processor and the tokenizer: vLLM builds its own MiniCPMVProcessor from them."""

    attributes = ["image_processor", "tokenizer"]
    image_processor_class = "AutoImageProcessor"
    tokenizer_class = "AutoTokenizer"

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)


class TinyMiniCPMOProcessor(ProcessorMixin):
    """MiniCPM-o's: the image processor, transformers' Whisper feature extractor and the tokenizer, from
    which vLLM builds its own MiniCPMOProcessor."""

    attributes = ["image_processor", "feature_extractor", "tokenizer"]
    image_processor_class = "AutoImageProcessor"
    feature_extractor_class = "WhisperFeatureExtractor"
    tokenizer_class = "AutoTokenizer"

    def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, feature_extractor, tokenizer, chat_template=chat_template)
'''


# vLLM's vendored MiniCPMOProcessor reads token ids off the tokenizer as the hub's tokenizer class
# has them (im_start_id, slice_start_id, audio_start_id, spk_start_id, ...): our own minimal subclass.
AUDIO_SPECIALS = ["<audio>", "</audio>", "<|spk_bos|>", "<|spk_eos|>"]
TOKENIZER_SOURCE = '''"""A minimal tokenizer class for a tiny random-weight test checkpoint (vlm-caption
tests/tiny_remote_minicpm.py): the fast tokenizer with the token-id properties vLLM's MiniCPM-o processor
reads. Not the model repository's code."""

from transformers import PreTrainedTokenizerFast


def _token_id(token):
    return property(lambda self: self.convert_tokens_to_ids(token))


class TinyMiniCPMTokenizerFast(PreTrainedTokenizerFast):
    im_start_id, im_end_id = _token_id("<image>"), _token_id("</image>")
    slice_start_id, slice_end_id = _token_id("<slice>"), _token_id("</slice>")
    audio_start_id, audio_end_id = _token_id("<audio>"), _token_id("</audio>")
    spk_start_id, spk_end_id = _token_id("<|spk_bos|>"), _token_id("<|spk_eos|>")
    eot_id = _token_id("<|im_end|>")
    bos_id = property(lambda self: self.bos_token_id)
    eos_id = property(lambda self: self.eos_token_id)
    unk_id = property(lambda self: self.unk_token_id)
'''


def build_tiny_minicpmv(out: Path, seed: int = 0) -> Path:
    return _build(out, seed)


# MiniCPM-o 2.6: MiniCPM-V 2.6 with a Whisper audio encoder (apm; vLLM projects encoder_ffn_dim / 4 =
# d_model features), its projection and pooling (the
# TTS head is not loaded by vLLM); transformers' WhisperFeatureExtractor stands in for the hub's.
MINICPMO_AUDIO = dict(model_type="whisper", d_model=64, encoder_layers=2, encoder_attention_heads=1,
                      encoder_ffn_dim=256, decoder_layers=1, decoder_attention_heads=1, decoder_ffn_dim=128,
                      num_mel_bins=80, max_source_positions=1500, activation_function="gelu")


def build_tiny_minicpmo(out: Path, seed: int = 0) -> Path:
    """MiniCPM-o 2.6 (openbmb/MiniCPM-o-2_6; recipe minicpmo)."""
    return _build(out, seed, audio=True)


def _build(out: Path, seed: int, audio: bool = False) -> Path:
    out = Path(out)
    if done(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    # bos: vLLM's vendored processor puts the tokenizer's bos id before the text it converts.
    fast, ids = tokenizer(out, MINICPMV_SPECIALS + (AUDIO_SPECIALS if audio else []), bos="<|im_start|>",
                          eos="<|im_end|>", pad="<|endoftext|>", unk="<unk>",
                          chat_template=chatml_template("You are a helpful assistant."))
    text = text_config(fast, ids, "qwen2", "Qwen2ForCausalLM", eos="<|im_end|>")
    write_remote_config(out, dict(
        text, model_type="minicpmo" if audio else "minicpmv", architectures=["MiniCPMO" if audio else "MiniCPMV"],
        version="2.6", query_num=QUERY_NUM,
        **(dict(audio_config=MINICPMO_AUDIO, audio_pool_step=2, audio_chunk_length=1.0, init_vision=True,
                init_audio=True, init_tts=False) if audio else {}),
        vision_config=MINICPMV_VISION, image_size=IMAGE["scale_resolution"], patch_size=IMAGE["patch_size"],
        slice_mode=True, slice_config=dict(max_slice_nums=IMAGE["max_slice_nums"], patch_size=IMAGE["patch_size"],
                                           scale_resolution=IMAGE["scale_resolution"]),
        batch_vision_input=True, use_image_id=True, drop_vision_last_layer=False),
        {"vision_config": "siglip_vision_model", "audio_config": "whisper"}, base="qwen2",
        class_name="MiniCPMOConfig" if audio else "MiniCPMVConfig")
    (out / "processing_tiny.py").write_text(PROCESSOR_SOURCE)
    processor = "TinyMiniCPMOProcessor" if audio else "TinyMiniCPMVProcessor"
    auto_map = {"AutoImageProcessor": "processing_tiny.TinyMiniCPMVImageProcessor",
                "AutoProcessor": f"processing_tiny.{processor}"}
    write_json(out / "preprocessor_config.json", dict(IMAGE, image_processor_type="TinyMiniCPMVImageProcessor",
                                                      processor_class=processor, auto_map=auto_map))
    write_json(out / "processor_config.json", dict(processor_class=processor,
                                                   auto_map={"AutoProcessor": auto_map["AutoProcessor"]}))
    if audio:
        import json

        from transformers import WhisperFeatureExtractor

        (out / "tokenization_tiny.py").write_text(TOKENIZER_SOURCE)
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["auto_map"] = {"AutoTokenizer": [None, "tokenization_tiny.TinyMiniCPMTokenizerFast"]}
        write_json(out / "tokenizer_config.json", config)

        WhisperFeatureExtractor(feature_size=MINICPMO_AUDIO["num_mel_bins"]).save_pretrained(out)
        # save_pretrained writes preprocessor_config.json: the image processor's comes back, under its own name
        extractor = (out / "preprocessor_config.json").read_text()
        (out / "feature_extractor_config.json").write_text(extractor)
        write_json(out / "preprocessor_config.json", dict(IMAGE, image_processor_type="TinyMiniCPMVImageProcessor",
                                                          processor_class=processor, auto_map=auto_map))
    v = MINICPMV_VISION
    e = v["hidden_size"]
    h = TEXT["hidden_size"]
    shapes: dict = {}
    siglip_tower_shapes(shapes, "vpm.", v)
    # The resampler: QUERY_NUM queries of the LM's width over the tower's keys (one 128-wide head).
    shapes["resampler.query"] = (QUERY_NUM, h)
    linear(shapes, "resampler.kv_proj", h, e)
    shapes["resampler.attn.in_proj_weight"] = (3 * h, h)
    shapes["resampler.attn.in_proj_bias"] = (3 * h,)
    linear(shapes, "resampler.attn.out_proj", h, h, bias=True)
    for norm in ("ln_q", "ln_kv", "ln_post"):
        layernorm(shapes, "resampler." + norm, h)
    shapes["resampler.proj"] = (h, h)
    llama_lm_shapes(shapes, "llm.", len(fast), qkv_bias=True)
    if audio:
        _audio_shapes(shapes, h)
    save_random(out, shapes, seed)
    return finish(out)


def _audio_shapes(shapes: dict, hidden: int) -> None:
    """The Whisper encoder as transformers names it (`apm.`), the projection to the LM, as vLLM loads them."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(**{k: v for k, v in MINICPMO_AUDIO.items() if k != "model_type"})
    for name, tensor in WhisperEncoder(config).state_dict().items():
        shapes["apm." + name] = tuple(tensor.shape)
    out_dim = MINICPMO_AUDIO["encoder_ffn_dim"] // 4
    linear(shapes, "audio_projection_layer.linear1", hidden, out_dim, bias=True)
    linear(shapes, "audio_projection_layer.linear2", hidden, hidden, bias=True)
