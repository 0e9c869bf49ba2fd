"""What a checkpoint's files say, for the model check (`model_check.py`): a local folder is a
complete checkpoint (config and every weight file), and its config's `model_type`."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from vlm_caption.recipes import RecipeError

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
CONFIG_FILES = ("config.json", "params.json")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Small files vLLM and transformers fetch beside the weights (config, tokenizer, processor).
SIDE_FILE_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py")
SKIP_HINT = "--skip-model-check (job field skip_model_check)"


class ModelError(RecipeError):
    """The model cannot be loaded, or is not a model the recipe is for; the message says what to do."""


@dataclass(frozen=True)
class ModelFound:
    """Where the model was found: a local folder, a complete snapshot in the hub cache, or the
    hub (to be downloaded: `download_bytes` into `cache_dir`)."""

    model: str
    where: str  # "folder", "cache" or "hub" (or "uri", "file": vLLM's to open, not checked)
    path: str | None = None  # the folder, or the cached snapshot
    model_type: str | None = None
    architectures: tuple[str, ...] = ()
    download_bytes: int = 0
    cache_dir: str | None = None


def looks_local(name: str) -> bool:
    """A folder that exists, or a name that can only be a path (not `namespace/name`)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if Path(name).expanduser().exists() or name.startswith(("/", "./", "../", "~", ".\\")) or name in (".", ".."):
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def check_folder(folder: Path, name: str) -> ModelFound:
    where = f"model folder {name}"
    if not folder.exists():
        raise ModelError(f"{where} does not exist. Point --model at a folder with the checkpoint's config.json "
                         "and weights, or give a hub id (namespace/name).")
    if not folder.is_dir():
        raise ModelError(f"{where} is a file, not a folder: point --model at the folder that holds config.json "
                         "and the weights.")
    try:
        # config.json, or params.json for a checkpoint in Mistral's own format
        config = next((folder / n for n in CONFIG_FILES if (folder / n).is_file()), None)
        weights = weights_problem(folder)
    except OSError as exc:
        raise ModelError(f"{where} cannot be read ({exc}).") from None
    if config is None or weights:
        missing = " and ".join(p for p in ("no config.json" if config is None else "", weights) if p)
        raise ModelError(f"{where} has {missing}: it is not a complete checkpoint. Copy the whole model "
                         f"repository there (e.g. `hf download <hub id> --local-dir {name}`), or point --model "
                         "at the folder that holds them.")
    model_type, architectures = read_config(config, where)
    return ModelFound(name, "folder", str(folder), model_type, architectures)


def weights_problem(folder: Path) -> str:
    """'' when the folder has its weights; else what is missing, in words."""
    for index in INDEX_FILES:
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                return f"an unreadable {index} ({exc})"
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                listed = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
                return (f"{len(missing)} of the {len(shards)} weight files {index} names missing ({listed}; "
                        "an incomplete download?)")
            return ""
    names = [p.name for p in folder.iterdir() if p.is_file()]
    if any(fnmatch.filter(names, pattern) for pattern in WEIGHT_PATTERNS):
        return ""
    return "no weights (*.safetensors, *.bin, *.pt, or an index json)"


def read_config(path: Path, where: str) -> tuple[str | None, tuple[str, ...]]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{where}: config.json cannot be read ({exc}); download it again.") from None
    return type_of(config)


def type_of(config: dict | None) -> tuple[str | None, tuple[str, ...]]:
    if not isinstance(config, dict):
        return None, ()
    return config.get("model_type"), tuple(config.get("architectures") or ())
