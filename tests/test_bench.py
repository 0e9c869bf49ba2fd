"""`vlm-caption bench` on CPU: the smoke run CI can afford (tiny checkpoint, a few images).
Its figures say nothing about a GPU; the test checks the comparison is made and reported."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_compares_the_flow_with_raw_vllm_and_writes_json(tmp_path):
    exe = Path(sys.executable).with_name("vlm-caption")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    done = subprocess.run([str(exe), "bench", "--dir", str(tmp_path / "bench"), "--images", "6", "--size", "160x120",
                           "--shard-size", "2", "--max-tokens", "3"],
                          capture_output=True, text=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "flow / raw" in done.stdout
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    for phase in ("raw", "flow"):
        assert report[phase]["items"] == 6
        assert report[phase]["generate_items_per_s"] > 0 and report[phase]["wall_s"] > 0
        assert report[phase]["output_tokens_per_s"] > 0 and report[phase]["peak_rss_mb"] > 0
    ratio = report["ratio_flow_over_raw"]
    assert ratio["generate_items_per_s"] == round(report["flow"]["generate_items_per_s"]
                                                  / report["raw"]["generate_items_per_s"], 3)
    assert report["raw"]["gpu_busy_pct"] is None  # no NVIDIA GPU here: no figure, not a made-up one
