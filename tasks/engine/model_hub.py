"""The hub side of the model check (`model_check.py`): a hub id complete in the cache, else one
`model_info` call (HF_TOKEN, HF_HUB_OFFLINE, HF_HOME or HF_HUB_CACHE, HF_ENDPOINT mean what they
mean to vLLM), what vLLM would still download, and whether the cache's disk has room for it."""

from __future__ import annotations

import difflib
import fnmatch
import functools
import hashlib
import os
import shutil
from pathlib import Path

from vlm_caption.recipes import all_recipes
from vlm_caption.tasks.engine.model_files import (
    CONFIG_FILES,
    INDEX_FILES,
    SIDE_FILE_PATTERNS,
    SKIP_HINT,
    ModelError,
    ModelFound,
    read_config,
    type_of,
    weights_problem,
)

HUB_TIMEOUT_S = float(os.environ.get("VLM_CAPTION_HUB_TIMEOUT_S", "10"))


def hub_cache_dir() -> str:
    """The hub cache as the engine's process will see it (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache and env.get("HF_HOME"):
        cache = os.path.join(env["HF_HOME"], "hub")
    return os.path.expanduser(os.path.expandvars(cache or constants.HF_HUB_CACHE))


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_offline() -> bool:
    from huggingface_hub import constants

    values = [os.environ.get(key, "").strip().upper() for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")]
    return any(value in ("1", "ON", "YES", "TRUE") for value in values) or bool(constants.HF_HUB_OFFLINE)


def token_key() -> str:
    """Which token the hub call used (a digest, for the memo of good answers)."""
    from huggingface_hub import get_token

    token = get_token() or ""
    return hashlib.sha256(token.encode()).hexdigest()[:16] if token else ""


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
    model_type, architectures = type_of(getattr(info, "config", None))
    needed = _download_bytes(repo, revision, info, cache_dir)
    free, folder = _free_bytes(cache_dir)
    if needed and free is not None and needed > free:
        raise ModelError(f"model {repo} needs about {_size(needed)} in the hub cache {cache_dir}, but only "
                         f"{_size(free)} are free on {folder}: free some space, set HF_HOME to a bigger disk, "
                         "or download it elsewhere and point --model at the folder.")
    return ModelFound(repo, "hub", None, model_type, architectures, needed, cache_dir)


def _from_cache(repo: str, revision: str | None, cache_dir: str) -> tuple[ModelFound | None, str]:
    """The model's snapshot if config and weights are all in the cache; else what is missing."""
    from huggingface_hub import try_to_load_from_cache

    config = None
    for name in CONFIG_FILES:
        try:
            config = try_to_load_from_cache(repo, name, cache_dir=cache_dir, revision=revision)
        except Exception as exc:  # noqa: BLE001 - an unreadable cache is a cache without the model
            _cache_unreadable(f"{repo} {name}", cache_dir, exc, "taken as not cached")
            config = None
        if isinstance(config, str):
            break
    if not isinstance(config, str):
        return None, ""
    snapshot = Path(config).parent
    problem = weights_problem(snapshot)
    if problem:
        return None, f"{snapshot} has {problem}"
    model_type, architectures = read_config(Path(config), f"cached model {repo}")
    return ModelFound(repo, "cache", str(snapshot), model_type, architectures, cache_dir=cache_dir), ""


def _ask_hub(repo: str, revision: str | None, suggest: str | None, cache_dir: str, endpoint: str, get_it: str):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    page = f"{endpoint}/{repo}"
    try:
        return HfApi(endpoint=endpoint).model_info(repo, revision=revision, files_metadata=True,
                                                   timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        has_token = "the token in HF_TOKEN has no access to it yet" if token_key() else "no HF_TOKEN is set"
        raise ModelError(f"model {repo} is gated and {has_token}: log in at {page}, accept its licence, then "
                         "set HF_TOKEN to a token of that account (or point --model at a downloaded folder)."
                         ) from None
    except RevisionNotFoundError:
        raise ModelError(f"model {repo} has no revision {revision!r} on the hub ({page}): fix the `revision` "
                         "engine argument.") from None
    except RepositoryNotFoundError:
        raise ModelError(_unknown_id(repo, suggest, cache_dir, page)) from None
    except DisabledRepoError:
        raise ModelError(f"model {repo} is disabled on the hub ({page}): pick another model.") from None
    except OfflineModeIsEnabled:
        raise ModelError(f"model {repo}: the hub is off (HF_HUB_OFFLINE) and the model is not in the cache "
                         f"at {cache_dir}: {get_it}.") from None
    except HfHubHTTPError as exc:
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
    `download_weights_from_hf` does) and the small files beside them, less what is cached."""
    from huggingface_hub import try_to_load_from_cache

    siblings = [s for s in (getattr(info, "siblings", None) or []) if "/" not in s.rfilename]
    names = [s.rfilename for s in siblings]
    weights: list[str] = []
    if INDEX_FILES[0] in names:  # the safetensors index names them; consolidated.* is left out
        weights = [n for n in fnmatch.filter(names, "*.safetensors") if not n.startswith("consolidated")]
    for pattern in ("*.safetensors", "*.bin", "*.pt"):
        if not weights:
            weights = fnmatch.filter(names, pattern)
    wanted = set(weights) | {n for p in SIDE_FILE_PATTERNS for n in fnmatch.filter(names, p)}
    total = 0
    for sibling in siblings:
        if sibling.rfilename not in wanted or not sibling.size:
            continue
        try:
            cached = try_to_load_from_cache(repo, sibling.rfilename, cache_dir=cache_dir, revision=revision)
        except Exception as exc:  # noqa: BLE001 - counted as still to download (the larger estimate)
            _cache_unreadable(f"{repo} {sibling.rfilename}", cache_dir, exc, "counted as still to download")
            cached = None
        if not isinstance(cached, str):
            total += sibling.size
    return total


def _cache_unreadable(what: str, cache_dir: str, exc: Exception, so: str) -> None:
    from vlm_caption.tasks.observability import get_logger

    get_logger().warning(f"hub cache unreadable for {what}; {so}", cache=cache_dir,
                         error=f"{type(exc).__name__}: {exc}")


def _free_bytes(cache_dir: str) -> tuple[int | None, str]:
    """Free space where the cache is (or will be created)."""
    folder = Path(cache_dir)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free, str(folder)
    except OSError:
        return None, str(folder)


def _size(count: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"
