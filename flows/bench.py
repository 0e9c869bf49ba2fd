"""`vlm-caption bench`: the flow against raw vLLM as the example runs it, on this machine.

One invocation builds (or takes) a checkpoint and N distinct JPEGs, then runs two phases one
after the other on the same GPU, each in a fresh child process so the first one's GPU memory is
gone before the second starts:

- raw: the example's way: decode every image serially, then one `LLM.generate` over all prompts;
- flow: the `vlm-caption` flow over the same images, from a folder or an S3 endpoint.

Both generate exactly `--max-tokens` per image (ignore_eos). It prints a table and writes JSON:
items/s while generating, items/s including decode, wall including engine start, time to the
first result, items/s once the engine is up (decode, listing and Prefect included), output
tokens/s, peak RSS, GPU busy % (NVML) between the first request and the
last result, and the ratio flow/raw of each. On a CPU-only machine the same comparison runs with
the tiny random-weight checkpoint (a smoke run: its figures say nothing about a GPU).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

METRICS = ("generate_items_per_s", "items_per_s", "wall_s", "first_result_s", "output_tokens_per_s",
           "peak_rss_mb", "gpu_busy_pct")


@dataclass(frozen=True)
class BenchConfig:
    workdir: str
    model: str | None = None
    recipe: str = "llava"
    images: int = 64
    width: int = 640
    height: int = 480
    shard_size: int = 64
    source: str = "folder"  # or "s3" (a loopback moto server, when moto is installed)
    max_tokens: int = 64
    shape: str = "tiny"  # without --model: a random-weight LLaVA of this shape ("tiny" or "7b")


def make_bench_images(folder: Path, count: int, width: int, height: int) -> Path:
    """`count` distinct photo-like JPEGs (noise over gradients: no two decode alike)."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    for i in range(count):
        path = folder / f"img-{i:06d}.jpg"
        if path.exists():
            continue
        noise = rng.normal(0, 40, (height, width, 3)).astype(np.float32)
        pixels = np.clip(ramp * ((i % 7) + 1) / 7 + noise + (i * 37 % 255), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(path, quality=90)
    return folder


# ---- phases (each in its own process) ----------------------------------------------------------
def phase_raw(cfg: BenchConfig, folder: Path, model: str) -> dict[str, Any]:
    from PIL import Image
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    from recipes import get_recipe
    from tasks.engine.arguments import EngineSpec, engine_args

    started = time.perf_counter()
    recipe = get_recipe(cfg.recipe)
    llm = LLM(**engine_args(EngineSpec.build(cfg.recipe, model=model), recipe, on_cpu=current_platform.is_cpu()))
    engine_s = time.perf_counter() - started
    prompt = recipe.prompting("image").text("Describe the content of this image in detail.", 1)
    decode_started = time.perf_counter()
    inputs = [{"prompt": prompt, "multi_modal_data": {"image": Image.open(p).convert("RGB")}}
              for p in sorted(folder.glob("*.jpg"))]
    decode_s = time.perf_counter() - decode_started
    generate_started = time.time()
    outputs = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=True),
                           use_tqdm=False)
    generate_s = time.time() - generate_started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"items": len(outputs), "engine_start_s": round(engine_s, 2), "decode_s": round(decode_s, 2),
            "generate_s": round(generate_s, 2), "generate_items_per_s": len(outputs) / generate_s,
            "items_per_s": len(outputs) / (time.perf_counter() - started - engine_s),
            "output_tokens_per_s": tokens / generate_s,
            "first_result_s": time.perf_counter() - started,  # generate returns everything at once
            "wall_s": time.perf_counter() - started,
            "window": [generate_started, generate_started + generate_s]}


def phase_flow(cfg: BenchConfig, folder: Path, model: str) -> dict[str, Any]:
    from flows.caption import vlm_caption
    from flows.params import CaptionJob

    started = time.perf_counter()
    source, output = str(folder), str(Path(cfg.workdir) / f"out-{int(time.time())}")
    if cfg.source == "s3":
        source, output = _s3_copy(folder)
    job = CaptionJob(source=source, output=output, recipe=cfg.recipe, model=model, shard_size=cfg.shard_size,
                     sampling={"max_tokens": cfg.max_tokens, "ignore_eos": True})
    summary = vlm_caption(job)
    from tasks.sources.storage import open_storage, split_parent

    folder_uri, name = split_parent(summary["manifest"])
    engine = json.loads(open_storage(folder_uri).read(name)).get("engine") or {}
    generate_s = summary["succeeded"] / summary["generate_items_per_s"] if summary["generate_items_per_s"] else 0
    wall = time.perf_counter() - started
    return {"items": summary["processed"], "engine_start_s": round(engine.get("startup_s", 0.0), 2),
            "generate_s": round(generate_s, 2), "generate_items_per_s": summary["generate_items_per_s"],
            "items_per_s": summary["processed"] / max(wall - engine.get("startup_s", 0.0), 1e-9),
            "output_tokens_per_s": summary["output_tokens_per_s"],
            "first_result_s": (summary["first_result_s"] or 0.0) + (wall - summary["wall_s"]),
            "wall_s": wall, "flow_wall_s": summary["wall_s"],
            "window": [time.time() - generate_s, time.time()]}


def _s3_copy(folder: Path) -> tuple[str, str]:
    """The images in a bucket of a loopback moto server (what CI and a GPU host without a real
    endpoint can run); `VLM_CAPTION_BENCH_S3` names a real prefix instead."""
    if os.environ.get("VLM_CAPTION_BENCH_S3"):
        base = os.environ["VLM_CAPTION_BENCH_S3"].rstrip("/")
        return f"{base}/images/", f"{base}/out-{int(time.time())}/"
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "VLM_CAPTION_S3_ENDPOINT_URL": f"http://{host}:{port}"})
    from tasks.settings import get_settings

    get_settings.cache_clear()
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
    client.create_bucket(Bucket="bench")
    for path in sorted(folder.glob("*.jpg")):
        client.put_object(Bucket="bench", Key=f"images/{path.name}", Body=path.read_bytes())
    return "s3://bench/images/", "s3://bench/out/"


def child_main(phase: str, config_json: str, folder: str, model: str) -> None:
    cfg = BenchConfig(**json.loads(config_json))
    result = (phase_raw if phase == "raw" else phase_flow)(cfg, Path(folder), model)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("BENCH-RESULT " + json.dumps(result), flush=True)


# ---- the driver ---------------------------------------------------------------------------------
class GpuSampler:
    """GPU utilization through NVML every 0.2 s (nothing on a machine without NVIDIA GPUs)."""

    def __init__(self):
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVIDIA driver: no figure
            self._nvml = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while self._nvml and not self._stop.wait(0.2):
            self.samples.append((time.time(), self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))

    def busy_pct(self, start: float, end: float) -> float | None:
        window = [u for t, u in self.samples if start <= t <= end]
        return round(sum(window) / len(window), 1) if window else None


def run_phase(phase: str, cfg: BenchConfig, folder: Path, model: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "flows.bench", phase, json.dumps(asdict(cfg)), str(folder), model]
    with GpuSampler() as gpu:
        done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH-RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"bench phase {phase} failed:\n{done.stderr[-4000:]}")
    result = json.loads(lines[-1].removeprefix("BENCH-RESULT "))
    result["gpu_busy_pct"] = gpu.busy_pct(*result.pop("window"))
    return result


def build_checkpoint(path: Path, shape: str) -> str:
    """The random-weight checkpoint, built in a child process: a 7B shape is initialised on the
    GPU, and memory this process kept would be missing from the engines measured after it."""
    code = f"from tasks.tiny_checkpoint import build_tiny_llava; build_tiny_llava({str(path)!r}, shape={shape!r})"
    subprocess.run([sys.executable, "-c", code], check=True)
    return str(path)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    work = Path(cfg.workdir).resolve()
    folder = make_bench_images(work / f"images-{cfg.width}x{cfg.height}-{cfg.images}", cfg.images,
                               cfg.width, cfg.height)
    model = cfg.model or build_checkpoint(work / f"llava-{cfg.shape}", cfg.shape)
    raw = run_phase("raw", cfg, folder, model)
    flow = run_phase("flow", cfg, folder, model)
    ratio = {m: round(flow[m] / raw[m], 3) for m in METRICS
             if isinstance(flow.get(m), (int, float)) and isinstance(raw.get(m), (int, float)) and raw[m]}
    report = {"config": {**asdict(cfg), "model": model}, "device": _device(), "raw": raw, "flow": flow,
              "ratio_flow_over_raw": ratio}
    (work / "bench.json").write_text(json.dumps(report, indent=2))
    _print_table(report, work / "bench.json")
    return report


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    except Exception:  # noqa: BLE001
        return "unknown"


def _print_table(report: dict[str, Any], path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"vlm-caption bench · {report['device']} · {report['config']['images']} images "
                        f"{report['config']['width']}x{report['config']['height']}")
    for column in ("metric", "raw (example's way)", "flow", "flow / raw"):
        table.add_column(column, justify="right" if column != "metric" else "left")
    for metric in METRICS:
        raw, flow = report["raw"].get(metric), report["flow"].get(metric)
        table.add_row(metric, _fmt(raw), _fmt(flow), _fmt(report["ratio_flow_over_raw"].get(metric)))
    Console().print(table)
    print(f"written: {path}")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:,.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    child_main(*sys.argv[1:5])
