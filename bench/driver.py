"""`vlm-caption bench`: the flow against raw vLLM as the example runs it, on this machine.

One invocation builds (or takes) a checkpoint and N distinct JPEGs, then runs two phases one
after the other on the same GPU, each in a fresh child process so the first one's GPU memory is
gone before the second starts:

- raw: the example's way: decode every item serially, then one `LLM.generate` over all prompts;
- flow: the `vlm-caption` flow over the same items, from a folder or an S3 endpoint (a real
  one, or a loopback moto server in a process of its own, filled before any phase); then, for
  each `--flow-env`, the flow again with those settings (e.g. VLM_CAPTION_PREPARE_AHEAD=4),
  each starting Prefect's embedded server, or with `--prefect server` against one server the
  bench starts before them (how a deployment's run finds its server);
- with `--gpus N`: first "raw, N processes" (`raw_n`): N raw scripts started at once, one per
  GPU (CUDA_VISIBLE_DEVICES=i; on a CPU machine just N processes), each given a contiguous 1/N
  of the items and run as raw is (serial decode, then one `LLM.generate`): how a person uses N
  GPUs by hand. Then, after the flow phases, the flow fanned out over N GPUs of this host
  (`fan_out=N`: the run on GPU 0, one process worker per other GPU running the partition
  deployment), reported over the flow on one GPU, as the GPUs' items/s together and each GPU's
  own, summed, and over raw, N processes.
- `--start-rounds N` adds N rounds of raw and the flow over a few items for the engine-ready
  gap's median (bench/rounds.py);
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
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from vlm_caption.bench.config import CHECKPOINTS, RESULT_FILE, BenchConfig
from vlm_caption.bench.harness import GpuSampler, partition_workers, prefect_api, s3_source
from vlm_caption.bench.media import make_bench_media, make_bench_tars
from vlm_caption.bench.processes import run_to_end, started
from vlm_caption.bench.report import engine_ready_gaps, ideal_fan_out, print_table, profile_summary, ratios, write_report
from vlm_caption.bench.rounds import run_start_rounds


def _read_result(path: Path, phase: str, returncode: int, stderr: str) -> dict[str, Any]:
    """A phase process's figures, or why there are none."""
    if returncode != 0 or not path.exists():
        raise RuntimeError(f"bench phase {phase} failed (exit {returncode}):\n{stderr[-4000:]}")
    result = json.loads(path.read_text())
    path.unlink()
    return result


def env_settings(overrides: str) -> dict[str, str]:
    """`--flow-env` / `--fan-out-env`'s "NAME=VALUE[,NAME=VALUE]" as environment entries."""
    return dict(pair.split("=", 1) for pair in overrides.split(",") if pair)


def run_phase(phase: str, cfg: BenchConfig, folder: Path, model: str, env_overrides: str = "",
              profile: Path | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One phase in a child process; `env`: where its Prefect API and its S3 endpoint are."""
    result_file = Path(cfg.workdir).resolve() / f"{phase}-result.json"
    result_file.unlink(missing_ok=True)
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", RESULT_FILE: str(result_file),
           **env_settings(env_overrides)}
    if cfg.gpus > 1:  # every phase's own engine on GPU 0; a fan-out's workers have the others
        env["CUDA_VISIBLE_DEVICES"] = "0"
    command = phase_command(phase, cfg, folder, model)
    if profile is not None:  # what holds the GIL in the flow's process and its children (needs py-spy)
        command = ["py-spy", "record", "--gil", "--threads", "--subprocesses", "--rate", "100", "--format", "raw",
                   "--output", str(profile), "--", *command]
    # The phase's process and all it started (its engine core, its embedded Prefect server) are
    # stopped as it ends, or as the bench does (an exception, Ctrl-C, SIGTERM): nothing left behind.
    with GpuSampler(devices=cfg.gpus if phase == "fan-out" else 1) as gpu:
        returncode, stdout, stderr = run_to_end(command, env=env)
    log = Path(cfg.workdir) / f"{phase}-{time.strftime('%H%M%S')}.log"  # the phase's own output, to look into
    log.write_text(stdout + stderr)
    result = _read_result(result_file, phase, returncode, stderr)
    window = result.pop("window")
    result["gpu_busy_pct"] = gpu.busy_pct(*window)
    result["gpu_busy_by_tenth"] = gpu.busy_by_tenth(*window)
    # Every sample, in seconds from the first request: where the GPU waited, to the second.
    log.with_suffix(".gpu.json").write_text(json.dumps(
        [[round(at - window[0], 2), busy] for at, busy in gpu.samples]))
    return result


def phase_command(phase: str, cfg: BenchConfig, folder: Path, model: str) -> list[str]:
    """A phase's process: `python -m vlm_caption.bench.phases <phase> <config> <folder> <model>`."""
    return [sys.executable, "-m", "vlm_caption.bench.phases", phase, json.dumps(asdict(cfg)), str(folder), model]


def run_raw_n(cfg: BenchConfig, folder: Path, model: str) -> dict[str, Any]:
    """Raw, N processes: N raw scripts started at once, process i on GPU i (CUDA_VISIBLE_DEVICES=i)
    over the i-th contiguous 1/N of the items, each as phase_raw runs (serial decode, then one
    `LLM.generate`). Times are from the phase's start (the launch of the N processes)."""
    work, stamp, count = Path(cfg.workdir).resolve(), time.strftime("%H%M%S"), cfg.gpus
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs, ended, results = [], {}, []
    # Each process stopped with all it started as the phase ends, or as the bench does (Ctrl-C):
    # no raw process, nor its engine core, left holding a GPU.
    with GpuSampler(devices=count) as gpu, contextlib.ExitStack() as running:
        started_at = time.time()
        for i in range(count):
            out, err = (running.enter_context(open(work / f"raw-n{i}-{stamp}.{kind}", "w+"))
                        for kind in ("out", "err"))
            (work / f"raw-n{i}-result.json").unlink(missing_ok=True)
            procs.append((running.enter_context(started(
                phase_command(f"raw-n:{i}:{count}", cfg, folder, model), stdout=out, stderr=err, text=True,
                env={**env, "CUDA_VISIBLE_DEVICES": str(i), RESULT_FILE: str(work / f"raw-n{i}-result.json")})), out, err))
        while len(ended) < count:  # when each process ended, to the tenth of a second
            for i, (proc, _, _) in enumerate(procs):
                if i not in ended and proc.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.1)
        for i, (proc, out, err) in enumerate(procs):
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            # each process's own output, as run_phase keeps it
            (work / f"raw-n{i}-{stamp}.log").write_text(stdout + stderr)
            results.append((proc.returncode, stderr))
    for kind, i in ((kind, i) for i in range(count) for kind in ("out", "err")):
        (work / f"raw-n{i}-{stamp}.{kind}").unlink()
    results = [_read_result(work / f"raw-n{i}-result.json", f"raw-n, process {i},", code, stderr)
               for i, (code, stderr) in enumerate(results)]
    result = raw_n_figures(results, started_at, [ended[i] for i in range(count)])
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
    module = "tasks.tiny_checkpoint" if recipe == "llava" else "bench.checkpoints"
    code = f"from vlm_caption.{module} import {builder}; {builder}({str(path)!r}, shape={shape!r})"
    subprocess.run([sys.executable, "-c", code], check=True)
    return str(path)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    if cfg.history:
        from vlm_caption.bench.history import run_history

        return run_history(cfg)
    cfg.check()
    work = Path(cfg.workdir).resolve()
    folder = make_bench_media(cfg, work)
    if cfg.source == "webdataset":
        make_bench_tars(folder, work)  # before any phase: packing is not the flow's time
    model = cfg.model or build_checkpoint(work, cfg.recipe, cfg.shape)
    profiles = [work / f"flow-profile-{i}.txt" if cfg.profile else None for i in range(len(cfg.flow_env) + 1)]
    report: dict[str, Any] = {"config": {**asdict(cfg), "model": model}, "device": _device(), "flow_env": {},
                              "raw": {}}
    # Each phase's figures are written as it ends: a run cut off (a lent GPU's time limit) keeps them.
    if cfg.warm_up and cfg.runs_raw():  # raw's kernels compiled (or found cached) before any raw phase
        report["warm_up"] = {k: v for k, v in run_phase("warm-up", cfg, folder, model).items()
                             if k in ("items", "engine_ready_s", "wall_s")}
        write_report(report, work)
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
        if cfg.warm_up:  # the flow's engine arguments differ from raw's: vLLM compiles (and caches) them apart
            report["flow_warm_up"] = {k: v for k, v in run_phase("flow-warm-up", cfg, folder, model, env=phase_env).items()
                                      if k in ("items", "engine_ready_s", "wall_s")}
            write_report(report, work)
        report["flow"] = run_phase("flow", cfg, folder, model, profile=profiles[0], env=phase_env)
        report["ratio_flow_over_raw"] = ratios(report["flow"], raw)
        if "raw_same" in report:
            report["ratio_flow_over_raw_same"] = ratios(report["flow"], report["raw_same"])
        write_report(report, work)
        for i, overrides in enumerate(cfg.flow_env, start=1):
            result = run_phase("flow", cfg, folder, model, overrides, profiles[i], phase_env)
            report["flow_env"][overrides] = {**result, "ratio_over_raw": ratios(result, raw)}
            write_report(report, work)
        if cfg.start_rounds:  # the engine-ready gap as a median: one pair of phases moves with the host
            report["start_rounds"] = run_start_rounds(
                cfg.start_rounds, lambda phase: run_phase(phase, cfg, folder, model, env=phase_env))
            write_report(report, work)
        fan_outs = [(cfg.gpus, overrides) for overrides in ("", *cfg.fan_out_env)] + [(m, "") for m in cfg.also_gpus]
        for gpus, overrides in fan_outs if cfg.gpus > 1 else ():
            settings = env_settings(overrides)
            with partition_workers(gpus, work, {**phase_env, **settings}):
                result = run_phase("fan-out", replace(cfg, gpus=gpus), folder, model, env={**phase_env, **settings})
            result = {**result, "gpus": gpus, "ratio_over_flow": ratios(result, report["flow"])}
            ideal = ideal_fan_out(report["flow"], gpus)
            if ideal:  # the bar: wall within 0.95 of E + G/N + T
                result.update(ideal=ideal, ideal_over_wall=round(ideal["wall_s"] / result["wall_s"], 3))
            if "raw_n" in report and gpus == cfg.gpus:  # its headline: ready_to_last_items_per_s, over raw, N processes
                result["ratio_over_raw_n"] = ratios(result, report["raw_n"])
            if gpus != cfg.gpus:
                report.setdefault("fan_out_gpus", {})[str(gpus)] = result
            elif overrides:
                report.setdefault("fan_out_env", {})[overrides] = result
            else:
                report["fan_out"] = result
            write_report(report, work)
    report["engine_ready_after_raw_s"] = engine_ready_gaps(report)
    if cfg.profile:  # one per flow phase: the default first, then each --flow-env
        report["flow_profiles"] = [profile_summary(path) for path in profiles]
    print_table(report, write_report(report, work))
    return report


def flow_processor_on_gpu(cfg: BenchConfig) -> bool:
    """Whether the flow's processor lands on the GPU (asked in this driver through NVML, which
    leaves CUDA uninitialised here)."""
    from vlm_caption.recipes import get_recipe
    from vlm_caption.tasks.engine.processor import place_processor

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
