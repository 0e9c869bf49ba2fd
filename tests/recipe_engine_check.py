"""The engine check of tests/recipe_check.py: each (recipe, modality) through the flow with a real engine.

    python -m tests.recipe_check engine [NAME ...] [--jobs N] --out FILE

One `vlm-caption run` per case (its own process, engine and Prefect home) on a folder of media made
here, with the recipe's prompt, engine arguments and stop tokens on the tiny checkpoint, 8 tokens
out. A case is ok when every item got a record without error and at least one output token. Cases
run `--jobs` at a time: tiny engines share one GPU, each with a small fixed KV cache, eager (the
check is about formats and loading, not speed), tensor parallel 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.recipe_check import CaseResult, cases
from tests.result_files import records as result_records

MAX_TOKENS = 8
CASE_TIMEOUT_S = int(os.environ.get("RECIPE_CHECK_CASE_TIMEOUT_S", "600"))  # per case; a GPU run may want less
# Small and fixed, so that several engines fit one GPU (or one CPU host) side by side.
SHARED_ENGINE_ARGS = {"tensor_parallel_size": 1, "enforce_eager": True, "kv_cache_memory_bytes": 256 * 1024**2}
GPU_KV_CACHE_BYTES = 3 * 1024**3


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def write_media(folder: Path, modality: str) -> Path:
    """Two images, one clip, or one group of two images (a folder), as the flow lists them."""
    from tests.images import image_bytes, video_bytes

    folder.mkdir(parents=True, exist_ok=True)
    if modality == "video":
        (folder / "clip.mp4").write_bytes(video_bytes(frames=24, fps=8, size=(64, 48)))
    elif modality == "multi-image":
        (folder / "album").mkdir(exist_ok=True)
        (folder / "album" / "a.jpg").write_bytes(image_bytes(size=(120, 90), color=(200, 30, 30)))
        (folder / "album" / "b.jpg").write_bytes(image_bytes(size=(90, 120), color=(30, 30, 200)))
    else:
        (folder / "a.jpg").write_bytes(image_bytes(size=(160, 120), color=(30, 160, 60)))
        (folder / "b.jpg").write_bytes(image_bytes(size=(120, 160), color=(160, 30, 60)))
    return folder


def flow_command(recipe: str, modality: str, checkpoint: Path, media: Path, out: Path,
                 gpu_share: float | None) -> list[str]:
    engine_args = dict(SHARED_ENGINE_ARGS)
    if gpu_share:  # on a GPU the KV cache must also hold the processor's 2 GiB (tasks/engine/processor.py)
        engine_args.update(gpu_memory_utilization=gpu_share, kv_cache_memory_bytes=GPU_KV_CACHE_BYTES)
    command = [sys.executable, "-m", "vlm_caption.flows.cli", "run", str(media), "--recipe", recipe, "--modality", modality,
               "--model", str(checkpoint), "--out", str(out), "--max-tokens", str(MAX_TOKENS), "--temperature", "0",
               "-v"]  # every engine line in the output read below (startup_s, the error)
    for key, value in engine_args.items():
        command += ["--engine-arg", f"{key}={json.dumps(value)}"]
    from vlm_caption.recipes import get_recipe

    if get_recipe(recipe).needs_remote_code:  # opted in as a user does; the tiny checkpoints' remote code is
        command.append("--trust-remote-code")  # our own config file (tests/tiny_remote_common.py)
    return command


def read_records(out: Path) -> list[dict]:
    return result_records(out)


def retryable_failures(out: Path) -> list[dict]:
    """The retryable errors the runs' manifests list (no file of the output keeps them once a run ends)."""
    return [failure for manifest in sorted(out.glob("manifests/*.json"))
            for failure in json.loads(manifest.read_text())["failures"] if failure.get("retryable")]


def run_case(recipe: str, modality: str, architecture: str, checkpoint: Path, work: Path, device: str,
             gpu_share: float | None) -> CaseResult:
    case = work / f"{recipe}-{modality}"
    media, out = write_media(case / "media", modality), case / "out"
    env = {**os.environ, "PREFECT_HOME": str(case / "prefect"), "HF_HUB_OFFLINE": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    started = time.perf_counter()
    row = dict(recipe=recipe, architecture=architecture, modality=modality, check="engine", device=device)
    try:
        done = subprocess.run(flow_command(recipe, modality, checkpoint, media, out, gpu_share), env=env,
                              capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return CaseResult(**row, ok=False, seconds=CASE_TIMEOUT_S, error=f"timed out after {CASE_TIMEOUT_S} s")
    seconds = round(time.perf_counter() - started, 1)
    (case / "log.txt").write_text(done.stdout + done.stderr)
    records = read_records(out)
    startup = re.search(r"startup_s=([\d.]+)", done.stdout + done.stderr)
    errors = [r["error"] for r in records if r.get("error")] + retryable_failures(out)
    ok = done.returncode == 0 and records and not errors and all(r["output_tokens"] > 0 for r in records)
    return CaseResult(**row, ok=bool(ok), prompt_tokens=max((r["prompt_tokens"] for r in records), default=0),
                      output_tokens=min((r["output_tokens"] for r in records), default=0),
                      seconds=float(startup.group(1)) if startup else seconds,
                      error="" if ok else _why(done, errors))


def _why(done: subprocess.CompletedProcess, errors: list) -> str:
    if errors:
        first = errors[0]
        return f"record error: {first.get('kind')}: {first.get('message')}"[:400]
    lines = [line for line in (done.stderr + done.stdout).splitlines()
             if "Error" in line or "error:" in line or "raise" in line]
    return (lines[-1] if lines else f"exit {done.returncode}, no records").strip()[:400]


def run_engine_checks(names: list[str] | None, modalities: list[str] | None, root: Path,
                      jobs: int = 1) -> list[CaseResult]:
    from tests.checkpoints import build_checkpoint

    device = _device()
    from vlm_caption.recipes import get_recipe

    # A recipe this vLLM no longer implements is refused by the job up front (tests/test_recipe_checks.py).
    todo = [case for case in cases(names, modalities) if not get_recipe(case[0]).removed_from_vllm]
    checkpoints, broken = {}, {}
    for arch in sorted({arch for _, _, arch in todo}):
        try:
            checkpoints[arch] = build_checkpoint(arch, root)
        except Exception as exc:  # noqa: BLE001 - a builder that fails is its cases' error
            broken[arch] = f"tiny checkpoint: {type(exc).__name__}: {exc}"[:400]
    work = Path(tempfile.mkdtemp(prefix="recipe-engine-check-"))
    share = round(0.9 / max(jobs, 1), 3) if device == "cuda" else None

    def one(case: tuple[str, str, str]) -> CaseResult:
        recipe, modality, architecture = case
        if architecture in broken:
            result = CaseResult(recipe, architecture, modality, "engine", device, False, error=broken[architecture])
        else:
            result = run_case(recipe, modality, architecture, checkpoints[architecture], work, device, share)
        print(json.dumps(result.__dict__), flush=True)
        return result

    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        rows = list(pool.map(one, todo))
    print(f"logs: {work}", file=sys.stderr)
    return rows
