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

from vlm_caption.bench.report import gap_split

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
    """Each round's gaps, flow less raw (`gap_split`: engine ready, the part before `vllm.LLM`
    began, the build's own; None for a round where a phase reported no engine), and each gap's
    median over the rounds that have them."""
    rounds = [{**result, "gaps": gap_split(result["flow"], result["raw"])} for result in results]
    counted = [r["gaps"] for r in rounds if r["gaps"]]
    median = {name: round(statistics.median(g[name] for g in counted), 2) for name in ("ready", "before_build", "build")} \
        if counted else None
    return {"rounds": rounds, "median": median}
