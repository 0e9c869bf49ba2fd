"""`--start-rounds N`: how much later the flow's engine is ready than raw's, as a median.

One phase's start moves by 10-15 s with what else the host is doing (docs/benchmarks.md, two
benches on one host), so one raw phase against one flow phase cannot judge a 5 s target. Each
round runs raw (with the flow's processor device, as "raw, same processor") and the flow over the
first WARM_UP_ITEMS items, each in a fresh process as every phase is, in alternating order
(raw first in even rounds, the flow first in odd ones) so that a drift of the host's pace weighs
on both; the figures are each round's gaps and their medians.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

START_FIELDS = ("engine_ready_s", "engine_start_s")  # ready from the process's start; `vllm.LLM`'s build


def run_start_rounds(rounds: int, run: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """`rounds` rounds of `run("start-raw")` and `run("start-flow")`; `run` runs one phase (the
    driver's run_phase with the bench's config, items, model and Prefect API)."""
    results = []
    for index in range(rounds):
        order = ("start-raw", "start-flow") if index % 2 == 0 else ("start-flow", "start-raw")
        figures = {phase: run(phase) for phase in order}
        results.append({side: {field: figures[f"start-{side}"].get(field) for field in START_FIELDS}
                        for side in ("raw", "flow")})
    return start_gaps(results)


def start_gaps(results: list[dict[str, dict[str, float | None]]]) -> dict[str, Any]:
    """Each round's gaps, flow less raw: engine ready, the part before `vllm.LLM` began, the
    build's own; and each gap's median over the rounds."""
    rounds = []
    for result in results:
        raw, flow = result["raw"], result["flow"]
        if None in (raw["engine_ready_s"], flow["engine_ready_s"], raw["engine_start_s"], flow["engine_start_s"]):
            rounds.append({**result, "gaps": None})  # a phase that reported no engine: not counted
            continue
        ready = flow["engine_ready_s"] - raw["engine_ready_s"]
        build = flow["engine_start_s"] - raw["engine_start_s"]
        rounds.append({**result, "gaps": {"ready": round(ready, 2), "before_build": round(ready - build, 2),
                                          "build": round(build, 2)}})
    counted = [r["gaps"] for r in rounds if r["gaps"]]
    median = {name: round(statistics.median(g[name] for g in counted), 2) for name in ("ready", "before_build", "build")} \
        if counted else None
    return {"rounds": rounds, "median": median}


def start_rounds_line(start: dict[str, Any]) -> str:
    """The table's line for the rounds."""
    median, counted = start["median"], [r["gaps"] for r in start["rounds"] if r["gaps"]]
    if median is None:
        return f"start rounds: none of {len(start['rounds'])} reported both engines"
    each = ", ".join(f"{g['ready']:+.2f}" for g in counted)
    return (f"engine ready, flow less raw with its processor, median of {len(counted)} rounds: {median['ready']:+.2f} s "
            f"({median['before_build']:+.2f} s before vllm.LLM began, {median['build']:+.2f} s in its build); "
            f"each round: {each} s")
