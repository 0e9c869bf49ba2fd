"""`vlm-caption bench` on CPU: the smoke run CI can afford (tiny checkpoint, a few images).
Its figures say nothing about a GPU; the test checks the comparison is made and reported."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_compares_the_flow_with_raw_vllm_and_writes_json(tmp_path):
    """Raw vLLM, then the flow reading from the bench's loopback S3 server (a process of its own)."""
    exe = Path(sys.executable).with_name("vlm-caption")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    done = subprocess.run([str(exe), "bench", "--dir", str(tmp_path / "bench"), "--images", "6", "--size", "160x120",
                           "--shard-size", "2", "--max-tokens", "3", "--source", "s3"],
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
    assert report["flow"]["gpu_busy_by_tenth"] == [None] * 10
    for phase in ("raw", "flow"):  # each phase's output, and its GPU samples (none here)
        (log,) = (tmp_path / "bench").glob(f"{phase}-*.log")
        assert json.loads(log.with_suffix(".gpu.json").read_text()) == []


def test_bench_runs_videos_and_image_groups_as_their_examples_do(tmp_path):
    """`--modality video` (clips, Qwen2-VL) and `--modality multi-image` (folders of two, the
    default recipe llava, rendered through its chat template), with one extra flow phase from
    `--flow-env`: every item captioned by both sides."""
    exe = Path(sys.executable).with_name("vlm-caption")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    for modality, extra in (("video", ["--recipe", "qwen2_vl", "--frames", "4", "--flow-env", "VLM_CAPTION_FEED_DEPTH=1"]),
                            ("multi-image", ["--prefect", "server"])):
        work = tmp_path / modality
        done = subprocess.run([str(exe), "bench", "--dir", str(work), "--modality", modality,
                               "--images", "4", "--size", "96x64", "--shard-size", "2", "--max-tokens", "3", *extra],
                              capture_output=True, text=True, timeout=1200, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads((work / "bench.json").read_text())
        assert report["config"]["modality"] == modality
        assert report["raw"]["items"] == report["flow"]["items"] == 4
        assert report["flow"]["output_tokens_per_s"] > 0
        # no GPU: the processor stays on the CPU in both, and raw runs once
        assert report["raw"]["processor_device"] == report["flow"]["processor_device"] == "cpu"
        assert "raw_same" not in report
        if modality == "video":
            (variant,) = report["flow_env"].values()
            assert variant["items"] == 4 and variant["ratio_over_raw"]["generate_items_per_s"] > 0
            assert report["flow"]["prefect_api"] == "embedded"
        else:  # a group is one item of two images; the flow ran against the bench's own server
            assert len(list((work / "multi-image-96x64-4").iterdir())) == 4
            assert report["flow"]["prefect_api"].startswith("http://127.0.0.1:")


def test_bench_fans_out_over_two_gpus_and_reports_over_one(tmp_path):
    """`--gpus 2 --skip-raw`: the flow on one device, then fanned out over two (the run on device
    0, a worker for device 1 running the partition deployment): every item once, each partition
    on its own device, its figures next to the one-device flow's, and the worker stopped."""
    import psutil

    exe = Path(sys.executable).with_name("vlm-caption")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    done = subprocess.run([str(exe), "bench", "--dir", str(tmp_path / "bench"), "--images", "8", "--size", "96x64",
                           "--shard-size", "2", "--max-tokens", "3", "--gpus", "2", "--skip-raw"],
                          capture_output=True, text=True, timeout=1500, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "flow on 2 GPUs" in done.stdout
    report = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert report["raw"] == {} and report["flow"]["items"] == report["fan_out"]["items"] == 8
    fan_out = report["fan_out"]
    assert [(p["index"], p["devices"], p["worker"]) for p in fan_out["partitions"]] == [
        (0, "0", None), (1, "1", "bench-gpu1")]  # partition 1 ran on the worker, not taken over
    assert sum(p["processed"] for p in fan_out["partitions"]) == 8
    assert fan_out["summed_gpu_items_per_s"] == sum(p["generate_items_per_s"] for p in fan_out["partitions"])
    assert fan_out["ratio_over_flow"]["summed_gpu_items_per_s"] == round(
        fan_out["summed_gpu_items_per_s"] / report["flow"]["summed_gpu_items_per_s"], 3)
    workers = [p for p in psutil.process_iter(["cmdline"]) if "bench-gpu1" in " ".join(p.info["cmdline"] or [])]
    assert workers == []


def test_the_profile_is_told_apart_by_process(tmp_path):
    """py-spy's raw output with --subprocesses: each child's stacks under its own process, told
    apart by what it runs (the engine core, the decode pool) and summarized on its own."""
    from flows.bench_report import profile_summary

    flow = 'process 10:"python -m flows.bench flow"'
    core = f'{flow};process 11:"python -c from multiprocessing.spawn import spawn_main"'
    (tmp_path / "p.txt").write_text("\n".join([
        f"{flow};thread (10): MainThread;<module> (bench.py:1);phase_flow (bench.py:2);wait (threading.py:3) 30",
        f"{flow};thread (12): feed;step (feed.py:9);add_request (llm_engine.py:5) 5",
        f"{flow};thread (12): feed;step (feed.py:9);_find_and_load (<frozen importlib._bootstrap>:1) 5",
        f"{core};thread (11): MainThread;run_engine_core (vllm/v1/engine/core.py:1);schedule (scheduler.py:7) 60",
        f"{core};thread (11): MainThread;run_engine_core (vllm/v1/engine/core.py:1);"
        f"EngineCore.__init__ (vllm/v1/engine/core.py:90);capture_model (gpu_model_runner.py:4) 20",
    ]))
    summary = profile_summary(tmp_path / "p.txt")
    assert summary["samples"] == 120
    core_row, flow_row = summary["processes"]
    assert (core_row["role"], core_row["samples"], core_row["share_of_all_pct"]) == ("vllm engine core", 80, 66.7)
    assert core_row["starting_pct"] == 25.0  # the engine's construction (CUDA-graph capture) is start-up
    assert core_row["by_function_pct"] == {"schedule (scheduler.py:7)": 75.0}
    assert flow_row["importing_pct"] == 12.5 and flow_row["by_function_pct"] == {
        "wait (threading.py:3)": 75.0, "add_request (llm_engine.py:5)": 12.5}
    assert flow_row["role"] == "flow" and flow_row["by_thread_pct"] == {"thread (10): MainThread": 75.0,
                                                                         "thread (12): feed": 25.0}


def test_gpu_busy_is_reported_over_the_window_and_each_tenth_of_it():
    """A ramp and a drained tail show in the first and last tenths, not only as a lower mean."""
    from flows.bench_harness import GpuSampler

    sampler = GpuSampler()
    # 0.2 s samples over 10 s: 50% in the first second, 100% after, 0% in the last second.
    sampler.samples = [(t / 5, 50.0 if t < 5 else 0.0 if t >= 45 else 100.0) for t in range(50)]
    assert sampler.busy_pct(0.0, 9.99) == 85.0
    assert sampler.busy_by_tenth(0.0, 9.99) == [50.0, *[100.0] * 8, 0.0]
    assert sampler.busy_pct(20.0, 30.0) is None  # no samples there: no figure
