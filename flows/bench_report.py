"""The bench's report: flow/raw ratios, `bench.json`, the terminal table, and a summary of
the py-spy profile (what held the GIL in the flow's process)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS = ("generate_items_per_s", "items_per_s", "wall_s", "first_result_s", "output_tokens_per_s",
           "peak_rss_mb", "gpu_busy_pct")


def write_report(report: dict[str, Any], work: Path) -> Path:
    path = work / "bench.json"
    path.write_text(json.dumps(report, indent=2))
    return path


def profile_summary(path: Path, top: int = 25) -> dict[str, Any]:
    """py-spy's collapsed stacks (GIL holders only) as the share of samples per innermost
    function and per thread: where the flow's process spends the interpreter."""
    from collections import Counter

    leaves, threads, total = Counter(), Counter(), 0
    for line in path.read_text().splitlines() if path.exists() else []:
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        total += int(count)
        threads[frames[0]] += int(count)
        leaves[frames[-1]] += int(count)
    share = lambda counter: {k: round(100 * v / total, 1) for k, v in counter.most_common(top)}  # noqa: E731
    return {"samples": total, "by_function_pct": share(leaves), "by_thread_pct": share(threads)}


def ratios(flow: dict[str, Any], raw: dict[str, Any]) -> dict[str, float]:
    return {m: round(flow[m] / raw[m], 3) for m in METRICS
            if isinstance(flow.get(m), (int, float)) and isinstance(raw.get(m), (int, float)) and raw[m]}


def print_table(report: dict[str, Any], path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    config = report["config"]
    table = Table(title=f"vlm-caption bench · {report['device']} · {config['images']} {config['modality']} "
                        f"items {config['width']}x{config['height']}")
    variants = report["flow_env"]
    for column in ("metric", "raw (example's way)", "flow", "flow / raw", *[c for env in variants for c in (env, "/ raw")]):
        table.add_column(column, justify="right" if column != "metric" else "left")
    for metric in METRICS:
        raw, flow = report["raw"].get(metric), report["flow"].get(metric)
        extra = [_fmt(v) for result in variants.values() for v in (result.get(metric), result["ratio_over_raw"].get(metric))]
        table.add_row(metric, _fmt(raw), _fmt(flow), _fmt(report["ratio_flow_over_raw"].get(metric)), *extra)
    Console().print(table)
    print(f"written: {path}")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:,.2f}" if isinstance(value, float) else str(value)
