"""`vlm-caption bench`: the flow against raw vLLM as the example runs it, on this machine.

One invocation builds (or takes) a checkpoint and N distinct JPEGs, then runs two phases one
after the other on the same GPU, each in a fresh child process so the first one's GPU memory is
gone before the second starts:

- raw: the example's way: decode every item serially, then one `LLM.generate` over all prompts;
- flow: the `vlm-caption` flow over the same items, from a folder or an S3 endpoint (a real
  one, or a loopback moto server in a process of its own, filled before any phase); then, for
  each `--flow-env`, the flow again with those settings (e.g. VLM_CAPTION_RENDER_PROCESSES=0),
  each starting Prefect's embedded server, or with `--prefect server` against one server the
  bench starts before them (how a deployment's run finds its server);
- with `--gpus N`: first "raw, N processes" (`raw_n`): N raw scripts started at once, one per
  GPU (CUDA_VISIBLE_DEVICES=i; on a CPU machine just N processes), each given a contiguous 1/N
  of the items and run as raw is (serial decode, then one `LLM.generate`): how a person uses N
  GPUs by hand. Then, after the flow phases, the flow fanned out over N GPUs of this host
  (`fan_out=N`: the run on GPU 0, one process worker per other GPU running the partition
  deployment), reported over the flow on one GPU, as the GPUs' items/s together and each GPU's
  own, summed, and over raw, N processes.
- `--skip-raw` leaves out raw on one GPU (and "raw, same processor"), not raw, N processes:
  a fan-out's ratio that matters is over the flow on one GPU and over raw, N processes;
  `--skip-raw-n` leaves raw, N processes out.

`--modality` picks images, videos (MP4 clips) or image groups (folders of two), each as the
matching example runs it (`vision_language.py` image and video, `vision_language_multi_image.py`).

Both generate exactly `--max-tokens` per image (ignore_eos; with `--json-schema` both answer in that
schema, up to `--max-tokens`, vLLM's structured outputs in both). It prints a table and writes JSON:
items/s while generating, items/s including decode, wall from the phase's process start
(imports and engine start included), time to the first result, items/s once the engine is up
(decode, listing and Prefect included), output tokens/s, peak RSS, GPU busy % (NVML) between
the first request and the last result, and the ratio flow/raw of each; each phase's engine-ready
time (`engine_ready_s`: from the phase's start, its process's or, for raw, N processes, the
launch of all N, to its first engine being ready; each partition's and each raw process's
apart) and `ready_to_last_items_per_s` (items/s from the first engine ready to the last result,
across the processes or partitions: the figure a fan-out is put over raw, N processes on).
On a CPU-only machine the same comparison runs with the tiny random-weight checkpoint (a smoke
run: its figures say nothing about a GPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flows.bench.config import CHECKPOINTS, BenchConfig
from flows.bench.harness import GpuSampler, partition_workers, prefect_api, s3_source
from flows.bench.media import GROUP_SIZE, bench_items, make_bench_media, make_bench_tars
from flows.bench.report import print_table, profile_summary, ratios, write_report


# ---- phases (each in its own process) ----------------------------------------------------------
def example_media(cfg: BenchConfig, paths: list[Path], needs_metadata: bool):
    """One item decoded as the examples do it, in the caller: PIL images, or sampled frames."""
    from PIL import Image

    if cfg.modality == "video":
        from tasks.media.video import VideoLimits, decode_video

        video = decode_video(paths[0].read_bytes(), num_frames=cfg.frames,
                             limits=VideoLimits(max_seconds=1e9, max_frame_pixels=1 << 40))
        return video.for_request(needs_metadata)
    images = [Image.open(p).convert("RGB") for p in paths]
    return images if cfg.modality == "multi-image" else images[0]


def phase_raw(cfg: BenchConfig, folder: Path, model: str, processor_device: str = "cpu",
              part: tuple[int, int] | None = None) -> dict[str, Any]:
    """Raw vLLM the example's way over every item, or, with `part` (i, n), over the i-th of n
    contiguous slices of them (one process of raw, N processes)."""
    started = _process_started()  # vLLM's import counts, as it does in the flow's wall
    process_started_at = time.time() - (time.perf_counter() - started)
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    from recipes import get_recipe
    from recipes.base import MEDIA_KIND
    from recipes.requests import prompt_text
    from tasks.engine.arguments import EngineSpec, eager_engine_processes, engine_plan

    recipe = get_recipe(cfg.recipe)
    items = bench_items(cfg, folder)
    if part is not None:
        items = raw_slice(items, *part)
    count = GROUP_SIZE if cfg.modality == "multi-image" else 1
    spec = EngineSpec.build(cfg.recipe, modality=cfg.modality, model=model, images=count,
                            processor_device=processor_device)
    args, placement = engine_plan(spec, recipe, on_cpu=current_platform.is_cpu())
    eager_engine_processes(args, on_cpu=current_platform.is_cpu())  # as the flow's engine starts
    llm = LLM(**args)
    engine_s = time.perf_counter() - started
    engine_ready_at = time.time()
    kind = MEDIA_KIND[cfg.modality]
    prompt = prompt_text(recipe.prompting(cfg.modality), llm.get_tokenizer(),
                         f"Describe the content of this {kind} in detail.", count, kind)
    decode_started = time.perf_counter()
    inputs = [{"prompt": prompt, "multi_modal_data": {kind: example_media(cfg, paths, recipe.needs_video_metadata)}}
              for paths in items]
    decode_s = time.perf_counter() - decode_started
    generate_started = time.time()
    structured = {}
    if cfg.json_schema:  # the request the flow sends for the same schema (tasks/engine/vllm_engine.py)
        from vllm.sampling_params import StructuredOutputsParams

        structured = {"structured_outputs": StructuredOutputsParams(json=cfg.structured())}
    outputs = llm.generate(inputs, SamplingParams(temperature=0.0, **cfg.sampling(), **structured), use_tqdm=False)
    generate_s = time.time() - generate_started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"items": len(outputs), "engine_start_s": round(engine_s, 2), "engine_ready_s": round(engine_s, 2),
            "decode_s": round(decode_s, 2), "output_tokens": tokens,
            # generate returns everything at once: its end is the last (and the first) result
            "ready_to_last_items_per_s": len(outputs) / max(generate_started + generate_s - engine_ready_at, 1e-9),
            "generate_s": round(generate_s, 2), "generate_items_per_s": len(outputs) / generate_s,
            "items_per_s": len(outputs) / (time.perf_counter() - started - engine_s),
            "output_tokens_per_s": tokens / generate_s,
            "first_result_s": time.perf_counter() - started,  # generate returns everything at once
            "wall_s": time.perf_counter() - started, "processor_device": placement.device,
            "process_started_at": process_started_at, "engine_ready_at": engine_ready_at,
            "window": [generate_started, generate_started + generate_s]}


def raw_slice(items: list, index: int, count: int) -> list:
    """The index-th of `count` contiguous slices of `items`, their sizes at most one apart."""
    return items[index * len(items) // count:(index + 1) * len(items) // count]


def phase_flow(cfg: BenchConfig, folder: Path, model: str, fan_out: int = 1) -> dict[str, Any]:
    started = _process_started()
    from flows.caption import take_partition_cores, vlm_caption
    from flows.params import CaptionJob
    from tasks.engine.vllm_engine import import_vllm_in_background

    source, output = str(folder), str(Path(cfg.workdir) / f"out-{int(time.time())}")
    if cfg.source == "s3":  # uploaded by the driver (flows/bench/harness.py, s3_source)
        base = os.environ["VLM_CAPTION_BENCH_S3"].rstrip("/")
        source, output = f"{base}/images/", f"{base}/out-{int(time.time())}/"
    elif cfg.source == "webdataset":  # the same JPEGs in tar shards (made by run_bench)
        source = str(make_bench_tars(folder, Path(cfg.workdir).resolve()))
    job = CaptionJob(source=source, output=output, recipe=cfg.recipe, model=model, shard_size=cfg.shard_size,
                     modality=cfg.modality, num_frames=cfg.frames, max_images=GROUP_SIZE,
                     sampling=cfg.sampling(), fan_out=fan_out, processor_device=cfg.processor_device,
                     json_schema=cfg.structured())
    take_partition_cores(job)  # as `vlm-caption run` does, before it imports vLLM
    import_vllm_in_background()
    summary = vlm_caption(job)
    from tasks.sources.storage import open_storage, split_parent

    folder_uri, name = split_parent(summary["manifest"])
    manifest = json.loads(open_storage(folder_uri).read(name))
    engine, window = manifest.get("engine") or {}, manifest["generate_window"] or [0.0, 0.0]
    wall = time.perf_counter() - started
    # The engine starts in the background once the listing shows work; it was ready this long
    # after the process started (raw's engine_ready_s counts from the process start too). A
    # fan-out's first engine: the earliest of the run's own and its partitions' (each partition's
    # report in the manifest carries its `engine_ready_at` where the run wrote one).
    process_started_at = time.time() - (time.perf_counter() - started)
    briefs = manifest.get("partitions") or []
    first_ready_at, last_result_at = first_ready_last_result(engine, window, briefs)
    ready_s = first_ready_at - process_started_at if first_ready_at else None
    partitions = [_partition_figures(p, process_started_at) for p in briefs]
    # Every answer counts, as in raw (the flow's own figure counts successes: under --json-schema
    # a random-weight model's answers rarely parse, yet each was generated).
    generating = summary["processed"] / max(window[1] - window[0], 1e-9)
    return {"items": summary["processed"], "engine_start_s": round(engine.get("startup_s", 0.0), 2),
            "engine_ready_s": round(ready_s, 2) if ready_s is not None else None,
            # from the first engine ready to the last result, across partitions: what a fan-out
            # is put over raw, N processes on
            "ready_to_last_items_per_s": (summary["processed"] / max(last_result_at - first_ready_at, 1e-9)
                                          if first_ready_at and last_result_at else None),
            "generate_s": round(window[1] - window[0], 2), "generate_items_per_s": generating,
            # Each GPU's items/s while it generated, summed: what the GPUs sustain together, apart
            # from when each partition's run started (a worker's poll, its process, its engine).
            "summed_gpu_items_per_s": (sum(p["generate_items_per_s"] for p in partitions) if partitions
                                       else generating),
            "failed": summary["failed"],  # under --json-schema: answers that did not parse
            "items_per_s": summary["processed"] / max(wall - ready_s, 1e-9) if ready_s is not None else None,
            "output_tokens_per_s": summary["output_tokens_per_s"],
            "first_result_s": (summary["first_result_s"] or 0.0) + (wall - summary["wall_s"]),
            "wall_s": wall, "flow_wall_s": summary["wall_s"],
            "prefect_api": os.environ.get("PREFECT_API_URL") or "embedded",
            "processor_device": (engine.get("sizing") or {}).get("processor_device"),
            "partitions": partitions, "window": window}


def first_ready_last_result(engine: dict[str, Any], window: list[float],
                            briefs: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """A flow run's first engine ready and last result (unix times), from its manifest: the
    earliest of its own engine's `ready_at` and its partitions' `engine_ready_at` (where the
    manifest carries them), the latest of its generate window's end and its partitions'."""
    ready = [at for at in (engine.get("ready_at"), *(b.get("engine_ready_at") for b in briefs)) if at]
    ends = [at for at in (window[1], *(b.get("generate_to") for b in briefs)) if at]
    return min(ready, default=None), max(ends, default=None)


def _partition_figures(brief: dict[str, Any], process_started_at: float) -> dict[str, Any]:
    """One partition of a fanned-out run as the manifest lists it, its times from the parent's
    process start: when its engine was ready, when it generated."""
    since = lambda at: round(at - process_started_at, 2) if at else None  # noqa: E731
    return {**{k: brief.get(k) for k in ("index", "worker", "devices", "processed", "generate_items_per_s")},
            "engine_ready_s": since(brief.get("engine_ready_at")),
            "generate_window_s": [since(brief.get("generate_from")), since(brief.get("generate_to"))]}


def _torch_gpu_peak_mb() -> float | None:
    """The most GPU memory torch held in this (front-end) process: the model processor's working
    memory when it runs on the GPU (its CUDA context comes on top); None where it never did."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    return round(torch.cuda.max_memory_reserved() / 2**20, 1)


def _process_started() -> float:
    """When this process started, on the `perf_counter` clock: both phases' walls include the
    interpreter's start and every import."""
    import psutil

    return time.perf_counter() - (time.time() - psutil.Process().create_time())


def child_main(phase: str, config_json: str, folder: str, model: str) -> None:
    cfg = BenchConfig(**json.loads(config_json))
    if phase == "raw":
        result = phase_raw(cfg, Path(folder), model)
    elif phase.startswith("raw-n:"):  # "raw-n:i:n": the i-th process of raw, N processes
        _, index, count = phase.split(":")
        result = phase_raw(cfg, Path(folder), model, part=(int(index), int(count)))
    elif phase == "raw-same":
        result = phase_raw(cfg, Path(folder), model, processor_device=cfg.processor_device)
    else:
        result = phase_flow(cfg, Path(folder), model, fan_out=cfg.gpus if phase == "fan-out" else 1)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["processor_gpu_peak_mb"] = _torch_gpu_peak_mb()
    # The driver reads the result from a file of its own: on stdout vLLM's processes write too, and a
    # line of theirs can run into this one ("(EngineCore pid=...) BENCH-RESULT ...", seen on CPU).
    Path(os.environ[RESULT_FILE]).write_text(json.dumps(result))
    print("BENCH-RESULT " + json.dumps(result), flush=True)  # for the phase's log


# ---- the driver ---------------------------------------------------------------------------------
RESULT_FILE = "VLM_CAPTION_BENCH_RESULT"  # where a phase's process writes its figures (JSON)


def _read_result(path: Path, phase: str, returncode: int, stderr: str) -> dict[str, Any]:
    """A phase process's figures, or why there are none."""
    if returncode != 0 or not path.exists():
        raise RuntimeError(f"bench phase {phase} failed (exit {returncode}):\n{stderr[-4000:]}")
    result = json.loads(path.read_text())
    path.unlink()
    return result


def run_phase(phase: str, cfg: BenchConfig, folder: Path, model: str, env_overrides: str = "",
              profile: Path | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One phase in a child process; `env`: where its Prefect API and its S3 endpoint are."""
    result_file = Path(cfg.workdir).resolve() / f"{phase}-result.json"
    result_file.unlink(missing_ok=True)
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", RESULT_FILE: str(result_file),
           **dict(pair.split("=", 1) for pair in env_overrides.split(",") if pair)}
    if cfg.gpus > 1:  # every phase's own engine on GPU 0; a fan-out's workers have the others
        env["CUDA_VISIBLE_DEVICES"] = "0"
    command = [sys.executable, "-m", "flows.bench.driver", phase, json.dumps(asdict(cfg)), str(folder), model]
    if profile is not None:  # what holds the GIL in the flow's process and its children (needs py-spy)
        command = ["py-spy", "record", "--gil", "--threads", "--subprocesses", "--rate", "100", "--format", "raw",
                   "--output", str(profile), "--", *command]
    with GpuSampler(devices=cfg.gpus if phase == "fan-out" else 1) as gpu:
        done = subprocess.run(command, capture_output=True, text=True, env=env)
    log = Path(cfg.workdir) / f"{phase}-{time.strftime('%H%M%S')}.log"  # the phase's own output, to look into
    log.write_text(done.stdout + done.stderr)
    result = _read_result(result_file, phase, done.returncode, done.stderr)
    window = result.pop("window")
    result["gpu_busy_pct"] = gpu.busy_pct(*window)
    result["gpu_busy_by_tenth"] = gpu.busy_by_tenth(*window)
    # Every sample, in seconds from the first request: where the GPU waited, to the second.
    log.with_suffix(".gpu.json").write_text(json.dumps(
        [[round(at - window[0], 2), busy] for at, busy in gpu.samples]))
    return result


def run_raw_n(cfg: BenchConfig, folder: Path, model: str) -> dict[str, Any]:
    """Raw, N processes: N raw scripts started at once, process i on GPU i (CUDA_VISIBLE_DEVICES=i)
    over the i-th contiguous 1/N of the items, each as phase_raw runs (serial decode, then one
    `LLM.generate`). Times are from the phase's start (the launch of the N processes)."""
    work, stamp, count = Path(cfg.workdir).resolve(), time.strftime("%H%M%S"), cfg.gpus
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs, ended = [], {}
    with GpuSampler(devices=count) as gpu:
        started = time.time()
        try:
            for i in range(count):
                out, err = (open(work / f"raw-n{i}-{stamp}.{kind}", "w+") for kind in ("out", "err"))
                command = [sys.executable, "-m", "flows.bench.driver", f"raw-n:{i}:{count}",
                           json.dumps(asdict(cfg)), str(folder), model]
                (work / f"raw-n{i}-result.json").unlink(missing_ok=True)
                procs.append((subprocess.Popen(command, stdout=out, stderr=err, text=True, start_new_session=True,
                                               env={**env, "CUDA_VISIBLE_DEVICES": str(i),
                                                    RESULT_FILE: str(work / f"raw-n{i}-result.json")}), out, err))
            while len(ended) < count:  # when each process ended, to the tenth of a second
                for i, (proc, _, _) in enumerate(procs):
                    if i not in ended and proc.poll() is not None:
                        ended[i] = time.time()
                time.sleep(0.1)
        finally:  # the bench stopped (Ctrl-C): no raw process, nor its engine core, left holding a GPU
            for proc, _, _ in procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    results = []
    for i, (proc, out, err) in enumerate(procs):
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        out.close()
        err.close()
        for kind in ("out", "err"):
            (work / f"raw-n{i}-{stamp}.{kind}").unlink()
        log = work / f"raw-n{i}-{stamp}.log"  # each process's own output, as run_phase keeps it
        log.write_text(stdout + stderr)
        results.append(_read_result(work / f"raw-n{i}-result.json", f"raw-n, process {i},", proc.returncode,
                                    stderr))
    result = raw_n_figures(results, started, [ended[i] for i in range(count)])
    window = result.pop("window")
    result["gpu_busy_pct"] = gpu.busy_pct(*window)
    result["gpu_busy_by_tenth"] = gpu.busy_by_tenth(*window)
    (work / f"raw-n-{stamp}.gpu.json").write_text(json.dumps(
        [[round(at - window[0], 2), busy] for at, busy in gpu.samples]))
    return result


def raw_n_figures(results: list[dict[str, Any]], started: float, ended: list[float]) -> dict[str, Any]:
    """Raw, N processes as one phase, from each process's figures (unix times: its engine
    ready, its generate window) and when it ended: items/s from the first engine ready to the
    last result (`ready_to_last_items_per_s`, what the fan-out is put over), while generating
    (the first request to the last result), each process's own; times in seconds from `started`."""
    since = lambda at: round(at - started, 2)  # noqa: E731
    items = sum(r["items"] for r in results)
    first_ready = min(r["engine_ready_at"] for r in results)
    first_request = min(r["window"][0] for r in results)
    last_result = max(r["window"][1] for r in results)
    processes = [{"index": i, "devices": str(i), "items": r["items"], "engine_ready_s": since(r["engine_ready_at"]),
                  "generate_window_s": [since(r["window"][0]), since(r["window"][1])],
                  "generate_items_per_s": r["generate_items_per_s"], "wall_s": since(end),
                  "peak_rss_mb": r.get("peak_rss_mb")}
                 for i, (r, end) in enumerate(zip(results, ended))]
    return {"items": items, "gpus": len(results), "engine_ready_s": since(first_ready),
            "ready_to_last_items_per_s": items / max(last_result - first_ready, 1e-9),
            "generate_s": round(last_result - first_request, 2),
            "generate_items_per_s": items / max(last_result - first_request, 1e-9),
            "summed_gpu_items_per_s": sum(r["generate_items_per_s"] for r in results),
            "items_per_s": items / max(max(ended) - first_ready, 1e-9),
            "output_tokens_per_s": sum(r["output_tokens"] for r in results) / max(last_result - first_request, 1e-9),
            "first_result_s": since(min(r["window"][1] for r in results)),
            "wall_s": since(max(ended)),
            "peak_rss_mb": max((r.get("peak_rss_mb") or 0.0) for r in results),  # the largest process's
            "processor_device": results[0].get("processor_device"),
            "processor_gpu_peak_mb": max((r.get("processor_gpu_peak_mb") for r in results
                                          if r.get("processor_gpu_peak_mb") is not None), default=None),
            "processes": processes, "window": [first_request, last_result]}


def build_checkpoint(work: Path, recipe: str, shape: str) -> str:
    """The random-weight checkpoint, built in a child process: a large shape is initialised on
    the GPU, and memory this process kept would be missing from the engines measured after it."""
    if recipe not in CHECKPOINTS or shape not in CHECKPOINTS[recipe][1]:
        known = ", ".join(f"{r} ({'/'.join(shapes)})" for r, (_, shapes) in CHECKPOINTS.items())
        raise SystemExit(f"the bench builds random-weight checkpoints for {known}; "
                         f"give --model for recipe {recipe!r} with shape {shape!r}")
    builder, path = CHECKPOINTS[recipe][0], work / f"{recipe}-{shape}"
    code = f"from tasks.tiny_checkpoint import {builder}; {builder}({str(path)!r}, shape={shape!r})"
    subprocess.run([sys.executable, "-c", code], check=True)
    return str(path)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    if cfg.source == "webdataset" and cfg.modality != "image":
        raise SystemExit("--source webdataset packs the bench's photos in tars: use it with --modality image")
    if cfg.gpus > 1 and cfg.source == "webdataset":
        raise SystemExit("--gpus reads the items from a folder or S3, not from tars")
    if cfg.runs_raw_n() and cfg.images < cfg.gpus:
        raise SystemExit(f"raw, {cfg.gpus} processes gives each at least one item: --images {cfg.gpus} or more "
                         "(or --skip-raw-n)")
    work = Path(cfg.workdir).resolve()
    folder = make_bench_media(cfg, work)
    if cfg.source == "webdataset":
        make_bench_tars(folder, work)  # before any phase: packing is not the flow's time
    model = cfg.model or build_checkpoint(work, cfg.recipe, cfg.shape)
    profiles = [work / f"flow-profile-{i}.txt" if cfg.profile else None for i in range(len(cfg.flow_env) + 1)]
    report: dict[str, Any] = {"config": {**asdict(cfg), "model": model}, "device": _device(), "flow_env": {},
                              "raw": {}}
    # Each phase's figures are written as it ends: a run cut off (a lent GPU's time limit) keeps them.
    if not cfg.skip_raw:
        report["raw"] = run_phase("raw", cfg, folder, model)
        write_report(report, work)
        if flow_processor_on_gpu(cfg):
            report["raw_same"] = run_phase("raw-same", cfg, folder, model)
            write_report(report, work)
    if cfg.runs_raw_n():  # before the flows, as raw: the same warm host, no server running beside it
        report["raw_n"] = run_raw_n(cfg, folder, model)
        write_report(report, work)
    raw = report["raw"]
    with contextlib.ExitStack() as serving:
        phase_env = serving.enter_context(prefect_api("server" if cfg.gpus > 1 else cfg.prefect, work))
        if cfg.source == "s3":
            phase_env = {**phase_env, **serving.enter_context(s3_source(folder, work))}
        report["flow"] = run_phase("flow", cfg, folder, model, profile=profiles[0], env=phase_env)
        report["ratio_flow_over_raw"] = ratios(report["flow"], raw)
        if "raw_same" in report:
            report["ratio_flow_over_raw_same"] = ratios(report["flow"], report["raw_same"])
        write_report(report, work)
        for i, overrides in enumerate(cfg.flow_env, start=1):
            result = run_phase("flow", cfg, folder, model, overrides, profiles[i], phase_env)
            report["flow_env"][overrides] = {**result, "ratio_over_raw": ratios(result, raw)}
            write_report(report, work)
        for overrides in ("", *cfg.fan_out_env) if cfg.gpus > 1 else ():
            settings = dict(pair.split("=", 1) for pair in overrides.split(",") if pair)
            with partition_workers(cfg.gpus, work, {**phase_env, **settings}):
                result = run_phase("fan-out", cfg, folder, model, env={**phase_env, **settings})
            result = {**result, "gpus": cfg.gpus, "ratio_over_flow": ratios(result, report["flow"])}
            if "raw_n" in report:  # its headline: ready_to_last_items_per_s, the fan-out over raw, N processes
                result["ratio_over_raw_n"] = ratios(result, report["raw_n"])
            if overrides:
                report.setdefault("fan_out_env", {})[overrides] = result
            else:
                report["fan_out"] = result
            write_report(report, work)
    report["engine_ready_after_raw_s"] = engine_ready_gaps(report)
    if cfg.profile:  # one per flow phase: the default first, then each --flow-env
        report["flow_profiles"] = [profile_summary(path) for path in profiles]
    print_table(report, write_report(report, work))
    return report


def engine_ready_gaps(report: dict[str, Any]) -> dict[str, float]:
    """How much later than raw's each flow phase's first engine was ready, each counted from its
    own phase's start (the issue's bound: a raw script's + 5 s): `flow_minus_raw` (the flow on one
    GPU against raw), `fan_out_minus_raw_n` (the fan-out's first engine against raw, N processes'
    first), where both phases ran."""
    ready = lambda phase: (report.get(phase) or {}).get("engine_ready_s")  # noqa: E731
    pairs = {"flow_minus_raw": ("flow", "raw"), "fan_out_minus_raw_n": ("fan_out", "raw_n")}
    return {name: round(ready(phase) - ready(base), 2) for name, (phase, base) in pairs.items()
            if ready(phase) is not None and ready(base) is not None}


def flow_processor_on_gpu(cfg: BenchConfig) -> bool:
    """Whether the flow's processor lands on the GPU (asked in this driver through NVML, which
    leaves CUDA uninitialised here)."""
    from recipes import get_recipe
    from tasks.engine.processor import place_processor

    try:
        from vllm.platforms import current_platform

        gpu = current_platform.is_cuda_alike()
    except Exception:  # noqa: BLE001 - no vLLM platform: no GPU figures either
        gpu = False
    return gpu and place_processor(get_recipe(cfg.recipe), cfg.processor_device, gpu=True).device == "cuda"


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    except Exception:  # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    child_main(*sys.argv[1:5])
