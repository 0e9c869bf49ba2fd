"""What the tiny checkpoints of the remote-code recipes share (tests/tiny_remote_*.py).

These models' hub repositories carry their own Python (`auto_map` in config.json): a config class,
sometimes a processor, always a model. vLLM 0.26 implements the models and, for most, builds the
multimodal processor itself; what a tiny checkpoint still lacks is usually only the config class
(the model_type transformers does not know). For that we write our own minimal config file into
the checkpoint -- `configuration_tiny.py`, below, one generic class -- and point `auto_map` at it:
`--trust-remote-code` then loads *our* file, never the model repository's code.

Where vLLM takes the processor from the checkpoint and neither vLLM nor transformers has it (Kimi-VL,
Keye-VL, MiniCPM-V/o, Nemotron-VL), the checkpoint also carries our own minimal processor / image
processor / tokenizer class (`processing_tiny.py`, `tokenization_tiny.py`, `image_processing_tiny.py`, in
tests/tiny_remote_kimi.py, tiny_remote_keye.py, tiny_remote_minicpm.py, tiny_remote_nemotron.py), written
from what vLLM's model file reads of it; where vLLM builds the vision tower from the checkpoint's code
(Nemotron-VL), a minimal tower with the interface vLLM calls (`modeling_tiny.py`).

Weights are written from (name, shape) tables in the hub's layout (what vLLM's `load_weights`
reads), with the helpers of tests/tiny_vllm_family.py; the language models are the standard
Llama / Qwen2 layouts.
"""

from __future__ import annotations

import json
from pathlib import Path

from vlm_caption.tasks.tiny_checkpoint import save_fast_tokenizer, train_tokenizer
from tests.tiny_vllm_family import _finish, _layernorm, _linear, _save_random, _write_json

__all__ = ["CONFIG_FILE", "TEXT", "chatml_template", "done", "finish", "layernorm", "linear", "llama_lm_shapes",
           "save_random", "siglip_tower_shapes", "tokenizer", "write_json", "write_remote_config"]

done = lambda out: (Path(out) / "model.safetensors").exists() and (Path(out) / "TINY_RANDOM_WEIGHTS").exists()  # noqa: E731
finish, layernorm, linear, save_random, write_json = _finish, _layernorm, _linear, _save_random, _write_json

# Text widths every builder shares: vLLM's CPU attention needs head_dim 64 (or 128); 2 layers.
TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-6,
            hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16")

CONFIG_FILE = "configuration_tiny.py"
# Our own config class, written into the checkpoint for a model_type transformers does not know.
# Sub-configs (vision_config, llm_config, ...) become transformers' class for their model_type
# where it has one (qwen2, llama, ...), else a plain PretrainedConfig with the same attributes (and, where
# the sub-config's `auto_map` names a model class in the checkpoint, the checkpoint's folder as its
# name_or_path, where AutoModel.from_config looks for that class).
CONFIG_SOURCE = '''"""A minimal config class for a tiny random-weight test checkpoint (vlm-caption tests/tiny_remote_common.py).

Not the model repository's code: it only holds config.json's values as attributes."""

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

SUB_CONFIGS = __SUB_CONFIGS__


def _sub_config(value, default_type, name_or_path):
    value = dict(value)
    model_type = value.pop("model_type", None) or default_type
    if model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type](**value)
    if "auto_map" in value:  # its model class is another of the checkpoint's files: found from its folder
        value["name_or_path"] = name_or_path
    config = PretrainedConfig(**value)
    config.model_type = model_type
    return config


class __CLASS__(__BASE__):
    model_type = __MODEL_TYPE__

    def __init__(self, **kwargs):
        for key, default_type in SUB_CONFIGS.items():
            value = kwargs.pop(key, None)
            if isinstance(value, dict):
                value = _sub_config(value, default_type, kwargs.get("name_or_path", ""))
            setattr(self, key, value)
        super().__init__(**kwargs)
'''


def write_remote_config(out: Path, config: dict, sub_configs: dict[str, str | None], base: str | None = None,
                        class_name: str = "TinyRemoteConfig") -> None:
    """config.json with `auto_map` to our configuration_tiny.py (model_type from `config`); `base`: the
    model_type of the transformers config class ours extends (a flat LM config, as dots.ocr's is Qwen2's);
    `class_name`: where vLLM checks the config's class by name."""
    source = CONFIG_SOURCE.replace("__SUB_CONFIGS__", repr(sub_configs)).replace(
        "__MODEL_TYPE__", repr(config["model_type"])).replace(
        "__BASE__", f"CONFIG_MAPPING[{base!r}]" if base else "PretrainedConfig").replace("__CLASS__", class_name)
    (out / CONFIG_FILE).write_text(source)
    auto_map = dict(config.pop("auto_map", {}), AutoConfig=f"configuration_tiny.{class_name}")
    write_json(out / "config.json", dict(config, auto_map=auto_map))


def chatml_template(system: str | None = None) -> str:
    """ChatML (Qwen2 / InternVL / Skywork): `<|im_start|>role\\ncontent<|im_end|>\\n`."""
    default = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\n" + system + "<|im_end|>\n{% endif %}"
               if system else "")
    return (default + "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer(out: Path, specials: list[str], *, eos: str, bos: str | None = None, pad: str | None = None,
              chat_template: str | None = None, extra: dict | None = None, fixed_ids: dict[str, int] | None = None,
              unk: str | None = None):
    """A trained byte-level BPE tokenizer with `specials` as single tokens; (tokenizer, {special: id}).

    `fixed_ids`: special tokens that must have the real model's ids (where vLLM hard-codes them), placed
    there after never-produced filler entries: the vocabulary becomes that large."""
    extra = {**({"chat_template": chat_template} if chat_template else {}), **(extra or {})}
    trained = train_tokenizer([t for t in specials if t not in (fixed_ids or {})])
    if fixed_ids:
        trained = _with_fixed_ids(trained, fixed_ids)
    fast = save_fast_tokenizer(trained, out, eos=eos, bos=bos, pad=pad, unk=unk, extra=extra)
    return fast, {t: fast.convert_tokens_to_ids(t) for t in specials}


def _with_fixed_ids(trained, fixed_ids: dict[str, int]):
    from tokenizers import AddedToken, Tokenizer

    data = json.loads(trained.to_str())
    vocab = data["model"]["vocab"]
    wanted = {i: t for t, i in fixed_ids.items()}
    assert min(wanted) >= len(vocab), "fixed ids must lie above the trained vocabulary"
    for i in range(len(vocab), max(wanted) + 1):
        vocab[wanted.get(i, f"<|tiny_filler_{i}|>")] = i
    tok = Tokenizer.from_str(json.dumps(data))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fixed_ids])
    return tok


def llama_lm_shapes(shapes: dict, prefix: str, vocab: int, text: dict = TEXT, *, qkv_bias: bool = False,
                    head: str | None = None) -> None:
    """A Llama / Qwen2 / Mistral LM in the hub's names under `prefix` (`{prefix}model.layers.N...`,
    `{prefix}lm_head.weight`, or `head` for the head's full name)."""
    h, inter = text["hidden_size"], text["intermediate_size"]
    hd = text.get("head_dim") or h // text["num_attention_heads"]
    q, kv = text["num_attention_heads"] * hd, text["num_key_value_heads"] * hd
    shapes[f"{prefix}model.embed_tokens.weight"] = (vocab, h)
    for i in range(text["num_hidden_layers"]):
        layer = f"{prefix}model.layers.{i}."
        layernorm(shapes, layer + "input_layernorm", h, bias=False)
        layernorm(shapes, layer + "post_attention_layernorm", h, bias=False)
        linear(shapes, layer + "self_attn.q_proj", q, h, bias=qkv_bias)
        linear(shapes, layer + "self_attn.k_proj", kv, h, bias=qkv_bias)
        linear(shapes, layer + "self_attn.v_proj", kv, h, bias=qkv_bias)
        linear(shapes, layer + "self_attn.o_proj", h, q)
        linear(shapes, layer + "mlp.gate_proj", inter, h)
        linear(shapes, layer + "mlp.up_proj", inter, h)
        linear(shapes, layer + "mlp.down_proj", h, inter)
    layernorm(shapes, f"{prefix}model.norm", h, bias=False)
    shapes[head or f"{prefix}lm_head.weight"] = (vocab, h)


def text_config(fast, ids: dict, model_type: str, architecture: str, *, eos: str, bos: str | None = None,
                **extra) -> dict:
    """An LM's config dict (the tiny widths) for this tokenizer."""
    return dict(TEXT, model_type=model_type, architectures=[architecture], vocab_size=len(fast),
                bos_token_id=ids.get(bos) if bos else None, eos_token_id=ids[eos],
                pad_token_id=fast.pad_token_id, rope_theta=10000.0, **extra)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def siglip_tower_shapes(shapes: dict, prefix: str, vision: dict, *, packing: bool = False) -> None:
    """A SigLIP vision tower's weights under `prefix` (`...vision_model.`): patch and position
    embeddings (and NaViT's packing positions), the encoder layers, the post-layernorm."""
    e, inter, p = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    shapes[prefix + "embeddings.patch_embedding.weight"] = (e, 3, p, p)
    shapes[prefix + "embeddings.patch_embedding.bias"] = (e,)
    shapes[prefix + "embeddings.position_embedding.weight"] = ((vision["image_size"] // p) ** 2, e)
    if packing:
        shapes[prefix + "embeddings.packing_position_embedding.weight"] = (32768, e)
    for i in range(vision["num_hidden_layers"]):
        layer = f"{prefix}encoder.layers.{i}."
        layernorm(shapes, layer + "layer_norm1", e)
        layernorm(shapes, layer + "layer_norm2", e)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(shapes, layer + "self_attn." + proj, e, e, bias=True)
        linear(shapes, layer + "mlp.fc1", inter, e, bias=True)
        linear(shapes, layer + "mlp.fc2", e, inter, bias=True)
    layernorm(shapes, prefix + "post_layernorm", e)
