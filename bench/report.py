"""The bench's report: flow/raw ratios, `bench.json`, the terminal table, and a summary of
the py-spy profile (what held the GIL in the flow's process)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

METRICS = ("generate_items_per_s", "ready_to_last_items_per_s", "summed_gpu_items_per_s", "items_per_s", "wall_s",
           "first_result_s", "output_tokens_per_s", "peak_rss_mb", "gpu_busy_pct", "processor_gpu_peak_mb")
# Shown in the table, not divided (how much later than raw's an engine was ready is a difference:
# `engine_ready_after_raw_s` in bench.json, printed under the table).
FACTS = ("engine_ready_s", "processor_device")


def write_report(report: dict[str, Any], work: Path) -> Path:
    path = work / "bench.json"
    path.write_text(json.dumps(report, indent=2))
    return path


# What a process is, told by a function only it runs (py-spy names spawned children by their
# command line, which is the same for every multiprocessing child). The decode pool's initializer
# (`_start_worker`) is told by its module: a video decode pool spends most of its samples in it,
# importing vLLM's loader.
PROCESS_ROLES = (("phase_flow", "flow"), ("phase_raw", "raw"), ("run_engine_core", "vllm engine core"),
                 ("(tasks/media/pool.py:", "decode pool"))


# Stacks that are start-up, not the steady state: imports, and the engine core's construction (the
# model load, the memory profile, the KV-cache blocks, the CUDA-graph capture). They are counted
# apart so that the functions show what holds each process back while it generates. (A forked
# engine core's stacks begin with its parent's `LLM.__init__`, so only the core's own frames tell.)
IMPORTING = "importlib._bootstrap"
ENGINE_CORE_FILE = "vllm/v1/engine/core.py:"


def _phase_of(frames: list[str]) -> str:
    if any(IMPORTING in frame for frame in frames):
        return "importing"
    if any(ENGINE_CORE_FILE in frame and frame.split(" (", 1)[0].endswith("__init__") for frame in frames):
        return "starting"
    return "steady"


def profile_summary(path: Path, top: int = 12) -> dict[str, Any]:
    """py-spy's collapsed stacks (GIL holders only, this process and its children) as the share
    of samples per process, and within each per thread and per innermost function (imports and
    engine start-up apart): where the interpreters of the flow, the engine core and the pools
    spend their time while items are generated."""
    from collections import Counter, defaultdict

    stacks: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    for line in _sample_lines(path):
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        depth = max((i for i, f in enumerate(frames) if f.startswith("process ")), default=-1)
        process = frames[depth].split(":", 1)[0] if depth >= 0 else "process"
        stacks[process].append((frames[depth + 1:], int(count)))
    total = sum(count for rows in stacks.values() for _, count in rows)
    processes = []
    for process, rows in stacks.items():
        leaves, threads, phases = Counter(), Counter(), Counter()
        for frames, count in rows:
            threads[frames[0]] += count
            phase = _phase_of(frames)
            phases[phase] += count
            if phase == "steady":
                leaves[frames[-1]] += count
        samples = sum(count for _, count in rows)
        share = lambda counter: {k: round(100 * v / samples, 1) for k, v in counter.most_common(top)}  # noqa: E731
        processes.append({"process": process, "role": _role(rows), "samples": samples,
                          "share_of_all_pct": round(100 * samples / total, 1),
                          "importing_pct": round(100 * phases["importing"] / samples, 1),
                          "starting_pct": round(100 * phases["starting"] / samples, 1),
                          "by_function_pct": share(leaves), "by_thread_pct": share(threads)})
    return {"samples": total, "processes": sorted(processes, key=lambda p: -p["samples"])}


def _sample_lines(path: Path):
    """One line per stack and its count; a child's command line can hold newlines (`python -c`
    of several lines), so a line without a trailing count goes on into the next."""
    pending = ""
    for line in path.read_text().splitlines() if path.exists() else []:
        pending += line
        head, _, count = pending.rpartition(" ")
        if head and count.isdigit():
            yield pending
            pending = ""
        else:
            pending += "\\n"


def _role(rows: list[tuple[list[str], int]]) -> str:
    text = ";".join(f for frames, _ in rows for f in frames)
    return next((role for marker, role in PROCESS_ROLES if marker in text), "other")


def ratios(flow: dict[str, Any], raw: dict[str, Any]) -> dict[str, float]:
    return {m: round(flow[m] / raw[m], 3) for m in METRICS
            if isinstance(flow.get(m), (int, float)) and isinstance(raw.get(m), (int, float)) and raw[m]}


# A prompt's text before its media is the same in every request and may be served from vLLM's
# prefix cache (a block or two); more than this share of all prompt tokens means media repeated.
CACHED_SHARE_WARNED = 0.25

GAP_NAMES = {"flow_minus_raw": "flow over raw", "flow_minus_raw_same": "flow over raw with its processor",
             "fan_out_minus_raw_n": "fan-out over raw, N processes",
             "flow_minus_raw_before_build": "of which before vllm.LLM began"}


def ideal_fan_out(flow: dict[str, Any], gpus: int) -> dict[str, float] | None:
    """The wall a fan-out over `gpus` GPUs would have if only generating divided: the 1-GPU flow's
    engine ready E (from its process start), its generating window G over N, and the rest of its
    wall T (the outputs after the last result, and any gap before the first), E + G/N + T. Each
    partition pays its own E, at best all at once, so no fan-out's wall is shorter than this."""
    ready, generating, wall = flow.get("engine_ready_s"), flow.get("generate_s"), flow.get("wall_s")
    if not (ready and generating and wall):
        return None
    rest = wall - ready - generating
    return {"engine_ready_s": round(ready, 2), "generate_s": round(generating, 2), "rest_s": round(rest, 2),
            "wall_s": round(ready + generating / gpus + rest, 2)}


def engine_ready_gaps(report: dict[str, Any]) -> dict[str, float]:
    """How much later than raw's each flow phase's first engine was ready, each counted from its
    own phase's start (the issue's bound: a raw script's + 5 s): `flow_minus_raw` (the flow on one
    GPU against raw), `flow_minus_raw_same` (against raw with the flow's processor device, where
    it ran), `fan_out_minus_raw_n` (the fan-out's first engine against raw, N processes' first),
    where both phases ran. `flow_minus_raw_before_build`: how much of the flow's gap came before
    `vllm.LLM` began (its imports, the plan), the rest being the build's own (engine_start_s)."""
    ready = lambda phase: (report.get(phase) or {}).get("engine_ready_s")  # noqa: E731
    pairs = {"flow_minus_raw": ("flow", "raw"), "flow_minus_raw_same": ("flow", "raw_same"),
             "fan_out_minus_raw_n": ("fan_out", "raw_n")}
    gaps = {name: round(ready(phase) - ready(base), 2) for name, (phase, base) in pairs.items()
            if ready(phase) is not None and ready(base) is not None}
    split = gap_split(report.get("flow") or {}, report.get("raw_same" if ready("raw_same") is not None else "raw") or {})
    if split is not None:
        gaps["flow_minus_raw_before_build"] = split["before_build"]
    return gaps


def gap_split(flow: dict[str, Any], raw: dict[str, Any]) -> dict[str, float] | None:
    """How much later the flow's engine was ready than raw's (`ready`), split where `vllm.LLM`
    began: the part before (`before_build`: imports, the plan) and the build's own (`build`,
    engine_start_s); None where either phase has no engine ready or no build of its own."""
    def began(phase: dict[str, Any]) -> tuple[float, float] | None:
        ready, build = phase.get("engine_ready_s"), phase.get("engine_start_s") or 0
        return (ready, build) if ready is not None and build > 0 else None

    if (flow_at := began(flow)) is None or (raw_at := began(raw)) is None:
        return None
    return {"ready": round(flow_at[0] - raw_at[0], 2),
            "before_build": round((flow_at[0] - flow_at[1]) - (raw_at[0] - raw_at[1]), 2),
            "build": round(flow_at[1] - raw_at[1], 2)}


def start_rounds_line(start: dict[str, Any]) -> str:
    """The table's line for `--start-rounds` (bench/rounds.py)."""
    median, counted = start["median"], [r["gaps"] for r in start["rounds"] if r["gaps"]]
    if median is None:
        return f"start rounds: none of {len(start['rounds'])} reported both engines"
    each = ", ".join(f"{g['ready']:+.2f}" for g in counted)
    return (f"engine ready, flow less raw with its processor, median of {len(counted)} rounds: {median['ready']:+.2f} s "
            f"({median['before_build']:+.2f} s before vllm.LLM began, {median['build']:+.2f} s in its build); "
            f"each round: {each} s")


def print_table(report: dict[str, Any], path: Path) -> None:
    """A column per phase, each followed by its ratio: the flow's and each --flow-env's over raw,
    the fan-out's over the flow on one GPU and over raw, N processes; then each raw process's and
    each partition's engine-ready time and rate, and how much later than raw's the flows' engines
    were ready."""
    from rich.console import Console
    from rich.table import Table

    config = report["config"]
    table = Table(title=f"vlm-caption bench · {report['device']} · {config['images']} {config['modality']} "
                        f"items {config['width']}x{config['height']}")
    columns = [("raw (example's way)", report["raw"], [])]
    if "raw_same" in report:  # raw again with the flow's processor device
        columns.append(("raw, same processor", report["raw_same"], []))
    flow_ratios = [("flow / raw", report["ratio_flow_over_raw"])]
    if "ratio_flow_over_raw_same" in report:
        flow_ratios.append(("flow / raw same", report["ratio_flow_over_raw_same"]))
    if "raw_n" in report:  # raw on N GPUs, one process each
        columns.append((f"raw, {report['raw_n']['gpus']} processes", report["raw_n"], []))
    columns.append(("flow", report["flow"], flow_ratios))
    columns += [(env, result, [("/ raw", result["ratio_over_raw"])]) for env, result in report["flow_env"].items()]
    if "fan_out" in report:
        fan_out = report["fan_out"]
        fan_ratios = [("/ flow", fan_out["ratio_over_flow"])]
        if "ratio_over_raw_n" in fan_out:
            fan_ratios.append((f"/ raw {fan_out['gpus']} processes", fan_out["ratio_over_raw_n"]))
        columns.append((f"flow on {fan_out['gpus']} GPUs", fan_out, fan_ratios))
        columns += [(f"{fan_out['gpus']} GPUs, {env}", result, [("/ flow", result["ratio_over_flow"])])
                    for env, result in report.get("fan_out_env", {}).items()]
        columns += [(f"flow on {gpus} GPUs", result, [("/ flow", result["ratio_over_flow"])])
                    for gpus, result in report.get("fan_out_gpus", {}).items()]
    table.add_column("metric")
    for name, _, ratio_columns in columns:
        table.add_column(name, justify="right")
        for ratio_name, _ in ratio_columns:
            table.add_column(ratio_name, justify="right")
    for metric in METRICS + FACTS:
        cells = []
        for _, result, ratio_columns in columns:
            cells += [_fmt(result.get(metric))] + [_fmt(values.get(metric)) for _, values in ratio_columns]
        table.add_row(metric, *cells)
    # Not a terminal (a log, CI): as wide as the table needs, so that metric names and headers
    # (a --flow-env column is named by its settings) are not cut; the table is no wider than that.
    Console(width=None if sys.stdout.isatty() else 10_000).print(table)
    for proc in report.get("raw_n", {}).get("processes", []):
        start, end = proc["generate_window_s"]
        print(f"raw process {proc['index']} on GPU {proc['devices']}: {proc['items']} items, engine ready at "
              f"{_fmt(proc['engine_ready_s'])} s, generated from {_fmt(start)} s to {_fmt(end)} s at "
              f"{_fmt(proc['generate_items_per_s'])} items/s, ended at {_fmt(proc['wall_s'])} s")
    fan_outs = [report.get("fan_out") or {}, *report.get("fan_out_gpus", {}).values()]
    for gpus, part in ((fan_out.get("gpus"), part) for fan_out in fan_outs for part in fan_out.get("partitions", [])):
        start, end = part["generate_window_s"]
        where = part["worker"] or "the run itself"
        print(f"{gpus} GPUs, partition {part['index']} on GPU {part['devices']} ({where}): "
              f"{part['processed']} items, asked at {_fmt(part.get('asked_s'))} s, its process began at "
              f"{_fmt(part.get('process_started_s'))} s, vllm.LLM at {_fmt(part.get('engine_build_began_s'))} s, "
              f"engine ready at {_fmt(part['engine_ready_s'])} s, generated from "
              f"{_fmt(start)} s to {_fmt(end)} s at {_fmt(part['generate_items_per_s'])} items/s")
    if "warm_up" in report:
        print(f"warm-up (raw, {report['warm_up']['items']} items, not compared): engine ready at "
              f"{_fmt(report['warm_up']['engine_ready_s'])} s")
    if "flow_warm_up" in report:
        print(f"warm-up (the flow, {report['flow_warm_up']['items']} items, not compared): engine ready at "
              f"{_fmt(report['flow_warm_up']['engine_ready_s'])} s")
    if not config.get("copies"):
        for name, result in [("flow", report["flow"]), *report["flow_env"].items(),
                             ("fan-out", report.get("fan_out") or {}), *report.get("fan_out_env", {}).items(),
                             *report.get("fan_out_gpus", {}).items()]:
            if result.get("copies"):
                print(f"WARNING: {name} took {result['copies']} of {result['items']} answers from items with the "
                      "same bytes (no request); raw asked each: its items/s are not raw's work")
    for name, result in (("raw", report.get("raw") or {}), ("raw, same processor", report.get("raw_same") or {})):
        cached, prompt = result.get("cached_prompt_tokens") or 0, result.get("prompt_tokens") or 0
        if prompt and cached > CACHED_SHARE_WARNED * prompt:
            print(f"WARNING: {name} took {cached} of its {prompt} prompt tokens ({100 * cached / prompt:.0f}%) from "
                  "vLLM's prefix cache: its items repeat, and the engine encoded each once")
    gaps = report.get("engine_ready_after_raw_s") or {}
    if gaps:
        print("engine ready later than raw's, each from its phase's start: " + ", ".join(
            f"{GAP_NAMES.get(name, name)} {value:+.2f} s" for name, value in gaps.items()))
    if "start_rounds" in report:
        print(start_rounds_line(report["start_rounds"]))
    for name, result in (("fan-out", report.get("fan_out") or {}), *report.get("fan_out_gpus", {}).items()):
        ideal = result.get("ideal")
        if ideal:
            print(f"{name} on {result['gpus']} GPUs: wall {result['wall_s']:.2f} s against its ideal E + G/N + T = "
                  f"{ideal['engine_ready_s']} + {ideal['generate_s']}/{result['gpus']} + {ideal['rest_s']} = "
                  f"{ideal['wall_s']} s (the 1-GPU flow's figures): ideal / wall {result['ideal_over_wall']:.3f}")
    ratio = report.get("fan_out", {}).get("ratio_over_raw_n", {}).get("ready_to_last_items_per_s")
    if ratio is not None:
        print(f"fan-out / raw {report['fan_out']['gpus']} processes, items/s from the first engine ready to the "
              f"last result: {ratio:.3f}")
    print(f"written: {path}")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:,.2f}" if isinstance(value, float) else str(value)
