"""Check the job's model before any engine starts: that it can be loaded (a complete local
folder, a hub id that is in the cache or that the hub will serve, room in the cache for its
download) and that it is the kind of model the recipe is for. A mistake is one `ModelError`
that says what to do, in about a second, instead of an engine start that ends in tracebacks. A
model fully in the cache is checked without the network; else one `model_info` call (HF_* variables
mean what they mean to vLLM), whose good answer is remembered: the CLI's check and the flow's cost one.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from vlm_caption.recipes import Recipe, RecipeError, all_recipes
from vlm_caption.tasks.errors import free_space

CONFIG_FILES = ("config.json", "params.json")  # params.json: a checkpoint in Mistral's own format
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Small files vLLM and transformers fetch beside the weights (config, tokenizer, processor).
SIDE_FILE_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py")
SKIP_HINT = "--skip-model-check (job field skip_model_check)"
HUB_TIMEOUT_S = float(os.environ.get("VLM_CAPTION_HUB_TIMEOUT_S", "10"))


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


def check_model(recipe: Recipe, modality: str = "image", model: str | None = None, *,
                revision: str | None = None) -> ModelFound:
    """Resolve `model` (default: the recipe's for `modality`) and check it fits `recipe`: the
    checkpoint's `model_type` is one the recipe is for (recipes that declare none, and checkpoints
    that state none, are not checked). Raise ModelError saying what is wrong and what to do."""
    found = resolve_model(recipe.model_for(modality, model), revision=revision, suggest=recipe.model)
    if not recipe.model_types or not found.model_type or found.model_type in recipe.model_types:
        return found
    kind = found.model_type
    arch = f" ({', '.join(found.architectures)})" if found.architectures else ""
    others = [r.name for r in all_recipes() if kind in r.model_types]
    wanted = " or ".join(repr(t) for t in recipe.model_types)
    if others:
        fix = f"Use --recipe {' or --recipe '.join(others)}"
    else:
        fix = "No recipe is for this model type (`vlm-caption recipes list` shows them); pick another model"
    raise ModelError(
        f"model {found.model} is a {kind!r} model{arch}, but recipe {recipe.name!r} is for {wanted} models "
        f"(its prompts would not match the model's). {fix}, or pass {SKIP_HINT} if this model really "
        f"takes the prompts of recipe {recipe.name!r}.")


def resolve_model(name: str, *, revision: str | None = None, suggest: str | None = None) -> ModelFound:
    """A local folder, or a hub id found in the cache or on the hub. A URI (s3://..., which vLLM
    streams) and a single GGUF file are vLLM's to open: not checked here."""
    from huggingface_hub import constants, get_token

    path = Path(name).expanduser()
    if "://" in name:
        return ModelFound(name, "uri")
    if name.endswith(".gguf") and path.is_file():
        return ModelFound(name, "file", str(path))
    if looks_local(name):
        return check_folder(path, name)
    # The hub's settings as the engine's process will see them (huggingface_hub reads them at its import).
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache and env.get("HF_HOME"):
        cache = os.path.join(env["HF_HOME"], "hub")
    cache = os.path.expanduser(os.path.expandvars(cache or constants.HF_HUB_CACHE))
    endpoint = (env.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    offline = constants.HF_HUB_OFFLINE or any(env.get(key, "").strip().upper() in ("1", "ON", "YES", "TRUE")
                                              for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    token = hashlib.sha256((get_token() or "").encode()).hexdigest()[:16]  # the memo's key, not the token
    return resolve_hub(name, revision, suggest, cache, endpoint, offline, token)


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
        config = next((folder / n for n in CONFIG_FILES if (folder / n).is_file()), None)
        weights = weights_problem(folder)
    except OSError as exc:
        raise ModelError(f"{where} cannot be read ({exc}).") from None
    if config is None or weights:
        missing = " and ".join(p for p in ("no config.json" if config is None else "", weights) if p)
        raise ModelError(f"{where} has {missing}: it is not a complete checkpoint. Copy the whole model "
                         f"repository there (e.g. `hf download <hub id> --local-dir {name}`), or point --model "
                         "at the folder that holds them.")
    return ModelFound(name, "folder", str(folder), *read_config(config, where))


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
    if any(fnmatch.filter(names, pattern) for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth")):
        return ""
    return "no weights (*.safetensors, *.bin, *.pt, or an index json)"


def read_config(path: Path, where: str) -> tuple[str | None, tuple[str, ...]]:
    try:
        return type_of(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{where}: config.json cannot be read ({exc}); download it again.") from None


def type_of(config: dict | None) -> tuple[str | None, tuple[str, ...]]:
    config = config if isinstance(config, dict) else {}
    return config.get("model_type"), tuple(config.get("architectures") or ())


@functools.lru_cache(maxsize=64)  # good answers only: an error is raised, never remembered
def resolve_hub(repo: str, revision: str | None, suggest: str | None, cache_dir: str, endpoint: str,
                offline: bool, token_key: str) -> ModelFound:
    cached, partial = _from_cache(repo, revision, cache_dir)
    if cached is not None:
        return cached
    get_it = (f"download it first with `hf download {repo}` (or `huggingface-cli download {repo}`) "
              "on a machine with access and copy the cache (HF_HOME), or point --model at a folder")
    if offline:
        state = f"only partly in the cache ({partial})" if partial else "not in the cache"
        raise ModelError(f"model {repo}: the hub is off (HF_HUB_OFFLINE=1) and the model is {state} "
                         f"at {cache_dir}: {get_it}.")
    info = _ask_hub(repo, revision, suggest, cache_dir, endpoint, get_it)
    needed = _download_bytes(repo, revision, info, cache_dir)
    free, folder = free_space(cache_dir)
    if needed and free is not None and needed > free:
        raise ModelError(f"model {repo} needs about {_size(needed)} in the hub cache {cache_dir}, but only "
                         f"{_size(free)} are free on {folder}: free some space, set HF_HOME to a bigger disk, "
                         "or download it elsewhere and point --model at the folder.")
    return ModelFound(repo, "hub", None, *type_of(getattr(info, "config", None)), needed, cache_dir)


def _cached(repo: str, name: str, revision: str | None, cache_dir: str, so: str) -> str | None:
    """The file's path in the cache, or None; an unreadable cache is logged with what it costs."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo, name, cache_dir=cache_dir, revision=revision)
    except Exception as exc:  # noqa: BLE001 - an unreadable cache is a cache without the file
        _cache_unreadable(f"{repo} {name}", cache_dir, exc, so)
        return None
    return found if isinstance(found, str) else None


def _from_cache(repo: str, revision: str | None, cache_dir: str) -> tuple[ModelFound | None, str]:
    """The model's snapshot if config and weights are all in the cache; else what is missing."""
    config = next(filter(None, (_cached(repo, name, revision, cache_dir, "taken as not cached")
                                for name in CONFIG_FILES)), None)
    if config is None:
        return None, ""
    snapshot = Path(config).parent
    problem = weights_problem(snapshot)
    if problem:
        return None, f"{snapshot} has {problem}"
    model_type, architectures = read_config(Path(config), f"cached model {repo}")
    return ModelFound(repo, "cache", str(snapshot), model_type, architectures, cache_dir=cache_dir), ""


def _ask_hub(repo: str, revision: str | None, suggest: str | None, cache_dir: str, endpoint: str, get_it: str):
    from huggingface_hub import HfApi, errors, get_token

    page = f"{endpoint}/{repo}"
    try:
        return HfApi(endpoint=endpoint).model_info(repo, revision=revision, files_metadata=True,
                                                   timeout=HUB_TIMEOUT_S)
    except errors.GatedRepoError:
        has_token = "the token in HF_TOKEN has no access to it yet" if get_token() else "no HF_TOKEN is set"
        raise ModelError(f"model {repo} is gated and {has_token}: log in at {page}, accept its licence, then "
                         "set HF_TOKEN to a token of that account (or point --model at a downloaded folder)."
                         ) from None
    except errors.RevisionNotFoundError:
        raise ModelError(f"model {repo} has no revision {revision!r} on the hub ({page}): fix the `revision` "
                         "engine argument.") from None
    except errors.RepositoryNotFoundError:
        raise ModelError(_unknown_id(repo, suggest, cache_dir, page)) from None
    except errors.DisabledRepoError:
        raise ModelError(f"model {repo} is disabled on the hub ({page}): pick another model.") from None
    except errors.OfflineModeIsEnabled:
        raise ModelError(f"model {repo}: the hub is off (HF_HUB_OFFLINE) and the model is not in the cache "
                         f"at {cache_dir}: {get_it}.") from None
    except errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status == 401:
            raise ModelError(f"model {repo}: the hub refused the token (HF_TOKEN, or `hf auth login`'s): set "
                             f"HF_TOKEN to a valid token ({endpoint}/settings/tokens).") from None
        if status == 403:
            raise ModelError(f"model {repo}: the token has no permission to read it ({page}): use a token "
                             "with read access, or point --model at a downloaded folder.") from None
        raise ModelError(f"model {repo}: the hub ({endpoint}) answered {status or 'an error'}; try again "
                         f"later, or {get_it} (or pass {SKIP_HINT} if vLLM can load it anyway).") from None
    except Exception as exc:  # noqa: BLE001 - connection refused, DNS, timeouts, proxies
        raise ModelError(f"model {repo}: cannot reach the hub ({endpoint}: {type(exc).__name__}) and the "
                         f"model is not in the cache at {cache_dir}: {get_it}.") from None


def _unknown_id(repo: str, suggest: str | None, cache_dir: str, page: str) -> str:
    known = {r.model for r in all_recipes()}
    if Path(cache_dir).is_dir():  # else no cache yet: only the recipes' models to suggest
        try:
            from huggingface_hub import scan_cache_dir

            known |= {r.repo_id for r in scan_cache_dir(cache_dir).repos if r.repo_type == "model"}
        except Exception as exc:  # noqa: BLE001 - a suggestion is not worth failing the check for
            _cache_unreadable("its models", cache_dir, exc, "suggestions leave out the cached models")
    by_lower = {k.lower(): k for k in known}
    close = [by_lower[c] for c in difflib.get_close_matches(repo.lower(), by_lower, n=3, cutoff=0.6)]
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    default = f" The recipe's default model is {suggest}." if suggest and suggest not in close else ""
    return (f"model {repo} is not a folder here and not a model on the hub ({page} not found; a private "
            f"repository needs HF_TOKEN).{hint}{default}")


def _download_bytes(repo: str, revision: str | None, info, cache_dir: str) -> int:
    """Bytes vLLM would still download: the weights of the format it picks (as
    `download_weights_from_hf` does) and the small files beside them, less what is cached
    (an unreadable cache counts as still to download: the larger estimate)."""
    siblings = [s for s in (getattr(info, "siblings", None) or []) if "/" not in s.rfilename]
    names = [s.rfilename for s in siblings]
    weights: list[str] = []
    if INDEX_FILES[0] in names:  # the safetensors index names them; consolidated.* is left out
        weights = [n for n in fnmatch.filter(names, "*.safetensors") if not n.startswith("consolidated")]
    for pattern in ("*.safetensors", "*.bin", "*.pt"):
        if not weights:
            weights = fnmatch.filter(names, pattern)
    wanted = set(weights) | {n for p in SIDE_FILE_PATTERNS for n in fnmatch.filter(names, p)}
    return sum(s.size for s in siblings if s.rfilename in wanted and s.size
               and _cached(repo, s.rfilename, revision, cache_dir, "counted as still to download") is None)


def _cache_unreadable(what: str, cache_dir: str, exc: Exception, so: str) -> None:
    from vlm_caption.tasks.observability import get_logger

    get_logger().warning(f"hub cache unreadable for {what}; {so}", cache=cache_dir,
                         error=f"{type(exc).__name__}: {exc}")


def _size(count: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"
