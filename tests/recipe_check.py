"""Prove recipes against real vLLM on tiny random-weight checkpoints, one row per (recipe, modality).

    python -m tests.recipe_check processing [NAME ...]            # vLLM's processor, no engine (seconds)
    python -m tests.recipe_check engine [NAME ...] --out FILE     # the flow with a real engine (GPU)
    python -m tests.recipe_check engine --rows FILE --update      # record a GPU run's rows (its --out file)

`processing` applies vLLM's own multimodal processor for the checkpoint (as vLLM's tests in
`tests/models/multimodal/processing` do) to the prompt the recipe builds, with the media the flow
would send: vLLM refuses a prompt whose placeholders do not match what its processor expands, so a
row that passes proves the recipe's format, not just its string. CI runs it for every recipe with a
tiny checkpoint (tests/test_recipe_checks.py). `engine` runs the flow on a folder of media with the
recipe's engine arguments and stop tokens, 8 tokens out. Both write the same rows; the recipes page
(docs/recipes.md) shows the committed ones (recipes/checks.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUESTION = "What is in it?"
GROUP_SIZE = 2  # images in a multi-image check
CLIP_FRAMES = 8
# Engine arguments that shape the processor's output (the rest size the engine).
PROCESSOR_ARGS = ("mm_processor_kwargs", "hf_overrides", "max_model_len", "tokenizer_mode", "limit_mm_per_prompt",
                  "trust_remote_code")
DEFAULT_ROOT = Path("/tmp/vlm-caption-checkpoints")


@dataclass(frozen=True)
class CaseResult:
    """One (recipe, modality) checked one way on one device."""

    recipe: str
    architecture: str
    modality: str
    check: str  # "processing" | "engine"
    device: str  # "cpu" | "cuda"
    ok: bool
    prompt_tokens: int = 0
    placeholder_tokens: int = 0  # tokens the media expanded to
    output_tokens: int = 0
    seconds: float = 0.0
    error: str = ""


def sample_media(modality: str, with_metadata: bool) -> Any:
    """What the flow sends vLLM for one item: a PIL image, a list of them, or decoded video frames."""
    from PIL import Image

    if modality == "image":
        return Image.new("RGB", (160, 120), (30, 160, 60))
    if modality == "multi-image":
        return [Image.new("RGB", (120, 90), (200, 30, 30)), Image.new("RGB", (90, 120), (30, 30, 200))][:GROUP_SIZE]
    from vlm_caption.tasks.media.video import VideoLimits, decode_video
    from tests.images import video_bytes

    clip = decode_video(video_bytes(frames=24, fps=8, size=(64, 48)), num_frames=CLIP_FRAMES,
                        limits=VideoLimits(max_seconds=60, max_frame_pixels=1 << 24))
    return clip.for_request(with_metadata)


def flow_engine_args(recipe_name: str, modality: str, checkpoint: Path, on_cpu: bool = True) -> dict[str, Any]:
    """The engine arguments the flow builds for this recipe on this checkpoint (context clamped to it);
    a remote-code recipe is opted in, as a user does with --trust-remote-code (the tiny checkpoint's
    remote code is our own minimal config file, tests/tiny_remote_common.py)."""
    from vlm_caption.recipes import get_recipe
    from vlm_caption.tasks.engine.arguments import EngineSpec, engine_plan

    recipe = get_recipe(recipe_name)
    spec = EngineSpec.build(recipe, modality=modality, model=str(checkpoint), images=GROUP_SIZE,
                            trust_remote_code=recipe.needs_remote_code)
    return engine_plan(spec, on_cpu=on_cpu)[0]


def recipe_prompt(recipe, modality: str, checkpoint: Path) -> str:
    """The prompt text the flow sends for one item (chat recipes rendered by the checkpoint's template)."""
    from vlm_caption.recipes.requests import build_requests, load_local_tokenizer

    tokenizer = load_local_tokenizer(str(checkpoint)) if recipe.uses_chat_template(modality) else None
    built = build_requests(recipe, modality, [QUESTION], images=GROUP_SIZE, model=str(checkpoint), tokenizer=tokenizer)
    return built.requests[0].prompt


@contextlib.contextmanager
def model_classes_inspected_here():
    """vLLM inspects a model class (multimodal? which interfaces?) in a new Python process the first
    time a machine meets it, so as not to initialize CUDA in its caller, and caches the answer under
    VLLM_CACHE_ROOT/modelinfos: on a fresh machine (CI's) that is vLLM and torch imported again for
    every architecture, about 10 s each on 2 cores, some 50 times. The processor check imports the
    model class here anyway (vLLM's processor registry lives on it), so here it is inspected too: the
    same answer, cached the same way. (vLLM without this function: inspected its own way.)"""
    from vllm.model_executor.models import registry

    in_subprocess = getattr(registry, "_run_in_subprocess", None)
    if in_subprocess is None:
        yield
        return
    registry._run_in_subprocess = lambda fn: fn()
    try:
        yield
    finally:
        registry._run_in_subprocess = in_subprocess


def check_processing(recipe_name: str, modality: str, checkpoint: Path, architecture: str = "") -> CaseResult:
    """vLLM's processor on the recipe's prompt and media; ok when every item's placeholders expanded."""
    from vlm_caption.recipes import get_recipe
    from vlm_caption.recipes.base import MEDIA_KIND
    from vlm_caption.recipes.requests import load_local_tokenizer
    from tests.vllm_processing import process

    recipe = get_recipe(recipe_name)
    started = time.perf_counter()
    row = dict(recipe=recipe_name, architecture=architecture, modality=modality, check="processing", device="cpu")
    try:
        args = flow_engine_args(recipe_name, modality, checkpoint)
        prompt = recipe_prompt(recipe, modality, checkpoint)
        kind = MEDIA_KIND[modality]
        media = {kind: sample_media(modality, recipe.needs_video_metadata)}
        processor_args = {key: args[key] for key in PROCESSOR_ARGS if key in args}
        with model_classes_inspected_here():
            processed = process(str(checkpoint), prompt, media, **processor_args)
        placeholders = processed["mm_placeholders"].get(kind, [])
        expected = GROUP_SIZE if modality == "multi-image" else 1
        if len(placeholders) != expected or any(p.length <= 0 for p in placeholders):
            raise AssertionError(f"{len(placeholders)} placeholder ranges for {expected} {kind} item(s)")
        # The engine tokenizes the prompt first and vLLM then applies the model's prompt update to
        # the tokens; from text the HF processor expands them. Both must give the model one prompt.
        # (A processor that puts the BOS in front of the text itself, as DeepSeek-VL2's does, may
        # leave it out from tokens: that alone is not a second prompt.)
        tokenizer = load_local_tokenizer(str(checkpoint))
        engine_ids = process(str(checkpoint), tokenizer.encode(prompt), media, **processor_args)["prompt_token_ids"]
        from_text, from_tokens = (_without_bos(ids, tokenizer.bos_token_id) for ids in
                                  (processed["prompt_token_ids"], engine_ids))
        if from_tokens != from_text:
            raise AssertionError(f"the engine's tokenized prompt becomes {len(from_tokens)} tokens, the text "
                                 f"{len(from_text)}: {_first_difference(from_tokens, from_text)}")
        return CaseResult(**row, ok=True, prompt_tokens=len(processed["prompt_token_ids"]),
                          placeholder_tokens=sum(p.length for p in placeholders),
                          seconds=round(time.perf_counter() - started, 2))
    except Exception as exc:  # noqa: BLE001 - the row records why a case fails
        return CaseResult(**row, ok=False, seconds=round(time.perf_counter() - started, 2), error=_one_line(exc))


def _without_bos(ids, bos: int | None) -> list[int]:
    ids = list(ids)
    return ids[1:] if ids and ids[0] == bos else ids


def _first_difference(left, right) -> str:
    at = next((i for i, (a, b) in enumerate(zip(left, right)) if a != b), min(len(left), len(right)))
    return f"from token {at}: {list(left[at:at + 6])} against {list(right[at:at + 6])}"


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:400]


def cases(names: list[str] | None = None, modalities: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(recipe, modality, architecture) for every checked recipe (or the named ones) and modality."""
    from vlm_caption.recipes import get_recipe
    from tests.checkpoints import RECIPE_CHECKPOINTS, checkpoint_architecture

    chosen = names or sorted(RECIPE_CHECKPOINTS)
    out = []
    for name in chosen:
        recipe = get_recipe(name)
        for modality in recipe.modalities:
            if modalities is None or modality in modalities:
                out.append((recipe.name, modality, checkpoint_architecture(recipe.name, modality)))
    return out


def run_processing(names: list[str] | None, modalities: list[str] | None, root: Path) -> list[CaseResult]:
    from tests.checkpoints import build_checkpoint

    rows = []
    for recipe, modality, architecture in cases(names, modalities):
        try:
            checkpoint = build_checkpoint(architecture, root)
        except Exception as exc:  # noqa: BLE001 - a builder that fails is that case's error
            traceback.print_exc()
            rows.append(CaseResult(recipe, architecture, modality, "processing", "cpu", False,
                                   error=f"tiny checkpoint: {_one_line(exc)}"))
            continue
        rows.append(check_processing(recipe, modality, checkpoint, architecture))
        print(json.dumps(asdict(rows[-1])), flush=True)
    return rows


def update_checks_file(check: str, rows: list[CaseResult], command: str, device: str | None = None,
                       adding: bool = False) -> None:
    """Replace these cases' rows in recipes/checks.json (other cases' rows stay). `device`: the engine
    run's device where it ran elsewhere (rows brought back); `adding`: these rows join the recorded
    run's (its date and command stay, this one's are appended)."""
    from vlm_caption.recipes.table import CHECKS_FILE, load_checks

    data = load_checks()
    fresh = {(r.recipe, r.modality) for r in rows}
    kept = [row for row in data[check] if (row["recipe"], row["modality"]) not in fresh]
    data[check] = sorted(kept + [asdict(r) for r in rows], key=lambda row: (row["recipe"], row["modality"]))
    if check == "engine" and rows:
        import vllm

        run = {"device": device or _device_name(), "vllm": vllm.__version__, "date": time.strftime("%Y-%m-%d"),
               "command": command.replace(" --update", "")}
        old = data["engine_run"]
        if adding and old:
            run = {**old, "date": old["date"] if run["date"] in old["date"] else f"{old['date']} and {run['date']}",
                   "command": f"{old['command']}; on {run['date']}"
                              + (f" ({run['device']})" if run["device"] != old.get("device") else "")
                              + f": {run['command']}"}
        data["engine_run"] = run
    CHECKS_FILE.write_text(json.dumps(data, indent=1) + "\n")


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.recipe_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=["processing", "engine"])
    parser.add_argument("names", nargs="*", help="recipes (default: every recipe with a tiny checkpoint)")
    parser.add_argument("--modality", action="append", choices=["image", "video", "multi-image"])
    parser.add_argument("--checkpoints", type=Path, default=DEFAULT_ROOT, help=f"built once here (default {DEFAULT_ROOT})")
    parser.add_argument("--out", type=Path, help="write the rows here as JSON")
    parser.add_argument("--jobs", type=int, default=1, help="engine cases run side by side (engine check)")
    parser.add_argument("--update", action="store_true",
                        help="write the rows into recipes/checks.json (the recipes page's source)")
    parser.add_argument("--rows", type=Path, help="take the rows from a file an earlier run wrote with --out (a "
                        "GPU run's, brought back) instead of running the checks; with --update, record them")
    parser.add_argument("--device-name", help="with --rows: the device the rows' run had (e.g. 'NVIDIA H100 80GB HBM3')")
    parser.add_argument("--command", help="with --rows: the command that made them (recorded with the engine rows)")
    args = parser.parse_args(argv)
    if args.rows:
        rows = [CaseResult(**row) for row in json.loads(args.rows.read_text()) if row["check"] == args.check]
    elif args.check == "processing":
        rows = run_processing(args.names or None, args.modality, args.checkpoints)
    else:
        from tests.recipe_engine_check import run_engine_checks

        rows = run_engine_checks(args.names or None, args.modality, args.checkpoints, jobs=args.jobs)
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    if args.update:
        command = args.command or " ".join(["python -m tests.recipe_check", *(argv or sys.argv[1:])])
        update_checks_file(args.check, rows, command, device=args.device_name, adding=bool(args.rows))
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} ok", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
