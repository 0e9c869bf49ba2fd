"""`vlm-caption demo` as a user runs it: offline, tiny random checkpoint, CPU build of vLLM."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_demo_runs_offline_and_says_captions_are_noise(tmp_path):
    cli = Path(sys.executable).with_name("vlm-caption")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    done = subprocess.run(
        [str(cli), "demo", "--dir", str(tmp_path / "demo"), "--images", "3"],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANDOM-WEIGHT" in done.stdout and "CAPTIONS ARE NOISE" in done.stdout
    results = tmp_path / "demo" / "results" / "results"
    parts = list(results.glob("*/*.jsonl"))
    records = [json.loads(line) for part in parts for line in part.read_text().splitlines()]
    assert sorted(r["key"] for r in records) == ["sample-00.jpg", "sample-01.png", "sample-02.webp"]
    assert all(r["error"] is None and r["output_tokens"] > 0 for r in records)
    assert f"results:  {results}" in done.stdout
    manifest = json.loads(next((tmp_path / "demo" / "results" / "manifests").glob("*.json")).read_text())
    assert manifest["counts"]["succeeded"] == 3
