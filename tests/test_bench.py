"""`vlm-caption bench` on CPU: the smoke run CI can afford (tiny checkpoint, a few images).
Its figures say nothing about a GPU; the test checks the comparison is made and reported."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import result_files


def _bench(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`vlm-caption bench` in a session of its own: however it ends (a failure, the timeout), it is
    stopped with every process it started (bench/processes.py), none left running (issue 68)."""
    from vlm_caption.bench.processes import run_to_end

    exe = Path(sys.executable).with_name("vlm-caption")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(tmp_path / "prefect")}
    command = [str(exe), "bench", "--dir", str(tmp_path / "bench"), "--size", "96x64", "--shard-size", "2",
               "--max-tokens", "3", *args]
    returncode, stdout, stderr = run_to_end(command, timeout=1500, grace=60, env=env)
    assert returncode == 0, stderr[-3000:]
    done = subprocess.CompletedProcess(command, returncode, stdout, stderr)
    return done, json.loads((tmp_path / "bench" / "bench.json").read_text())


@pytest.mark.timeout(400)  # a hang fails it, and its clean-up still runs
def test_a_bench_that_fails_part_way_leaves_no_process_behind(tmp_path, monkeypatch):
    """Issue 68: a failed bench had left its Prefect server, its loopback moto S3 and a worker
    running. Here the bench's own Prefect server and moto are up when the flow phase's process
    starts a child of its own (as a phase's engine core or embedded Prefect server does) and
    fails: the bench raises, and nothing it started is left, that orphaned child included."""
    import psutil

    from vlm_caption.bench import driver
    from vlm_caption.bench.config import BenchConfig

    ours = psutil.Process()
    before = {p.pid for p in ours.children(recursive=True)}  # a session fixture's server, if any
    pid_file = tmp_path / "phase-child.pid"
    phase = ("import subprocess, sys\n"
             "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
             f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
             "sys.exit('the phase failed')")
    monkeypatch.setattr(driver, "phase_command", lambda *args: [sys.executable, "-c", phase])
    cfg = BenchConfig(workdir=str(tmp_path / "bench"), model="m", images=2, width=32, height=24, source="s3",
                      prefect="server", skip_raw=True)
    with pytest.raises(RuntimeError, match="bench phase flow failed"):
        driver.run_bench(cfg)
    left = [p for p in ours.children(recursive=True) if p.pid not in before]
    assert left == [], [p.cmdline() for p in left]
    _assert_gone(int(pid_file.read_text()))


def test_a_process_the_bench_started_is_stopped_with_all_under_it_even_what_ignores_sigterm(tmp_path):
    """What `started` stops as its block raises (a timeout, as `_bench`'s): the process though it
    ignores SIGTERM (SIGKILL after the grace), and its child though that left its session."""
    import psutil

    from vlm_caption.bench.processes import started

    pid_file = tmp_path / "child.pid"
    script = ("import signal, subprocess, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "time.sleep(600)")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(subprocess.TimeoutExpired), started([sys.executable, "-c", script], grace=1) as proc:
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.1)
        proc.communicate(timeout=0.1)
    assert proc.returncode == -signal.SIGKILL  # it ignored SIGTERM
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before] == []
    _assert_gone(int(pid_file.read_text()))


def _assert_gone(pid: int) -> None:
    """The process is gone (or a zombie its new parent, init, has yet to reap)."""
    import psutil

    def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.time() + 10
    while not gone() and time.time() < deadline:
        time.sleep(0.1)
    assert gone(), psutil.Process(pid).cmdline()


def test_bench_compares_raw_flow_and_a_fan_out_on_videos_from_s3(tmp_path):
    """The one bench smoke CI runs (each phase starts an engine, so `--flow-env`'s extra phase is
    left to test_variants_get_their_own_columns). Raw vLLM as the video example runs it (Qwen2-VL
    clips), the flow reading them from the bench's loopback S3 server (a process of its own)
    against the bench's own Prefect server, then `--gpus 2`: raw, 2 processes (two raw scripts at
    once, one per device, half the clips each) and the flow fanned out over two devices (the run on
    device 0, a worker for device 1 running the partition deployment, which reads the loopback
    server's credentials block), all answering in the built-in tags schema (vLLM's structured
    outputs in raw and flow alike): every item answered by each, the ratios and the JSON written,
    each partition and each raw process on its own device with its engine-ready time, the fan-out
    over raw, 2 processes, the worker stopped, no made-up GPU figure."""
    import psutil

    from vlm_caption.flows.params import TAGS_SCHEMA

    done, report = _bench(tmp_path, "--recipe", "qwen2_vl", "--modality", "video", "--frames", "4", "--images", "4",
                          "--source", "s3", "--json-schema", "tags",
                          "--gpus", "2")
    assert "flow / raw" in done.stdout and "flow on 2 GPUs" in done.stdout
    assert "raw, 2 processes" in done.stdout and "/ raw 2 processes" in done.stdout
    assert report["config"]["modality"] == "video"
    assert json.loads(report["config"]["json_schema"]) == TAGS_SCHEMA
    # 3 tokens of a random-weight model rarely close the JSON: such answers are the flow's
    # structured_output errors, yet count as answered (items/s below), as raw counts every output.
    assert report["flow_env"] == {}
    fan_out, raw_n = report["fan_out"], report["raw_n"]
    for phase in (report["raw"], raw_n, report["flow"], fan_out):
        assert phase["items"] == 4
        assert phase["generate_items_per_s"] > 0 and phase["wall_s"] > 0
        assert phase["output_tokens_per_s"] > 0 and phase["peak_rss_mb"] > 0
        # from the phase's start to its first engine ready; items/s from there to the last result
        assert 0 < phase["engine_ready_s"] < phase["wall_s"] and phase["ready_to_last_items_per_s"] > 0
    # raw, 2 processes: two raw scripts, one per device, 2 clips each, each ready and done on its own
    assert [(p["index"], p["devices"], p["items"]) for p in raw_n["processes"]] == [(0, "0", 2), (1, "1", 2)]
    assert raw_n["engine_ready_s"] == min(p["engine_ready_s"] for p in raw_n["processes"])
    assert raw_n["wall_s"] == max(p["wall_s"] for p in raw_n["processes"])
    for proc in raw_n["processes"]:
        assert proc["engine_ready_s"] <= proc["generate_window_s"][0] <= proc["generate_window_s"][1] <= proc["wall_s"]
        assert proc["generate_items_per_s"] > 0
    assert fan_out["ratio_over_raw_n"]["ready_to_last_items_per_s"] == round(
        fan_out["ready_to_last_items_per_s"] / raw_n["ready_to_last_items_per_s"], 3)
    assert set(report["engine_ready_after_raw_s"]) == {"flow_minus_raw", "fan_out_minus_raw_n",
                                                       "flow_minus_raw_before_build"}
    ratio = report["ratio_flow_over_raw"]
    assert ratio["generate_items_per_s"] == round(report["flow"]["generate_items_per_s"]
                                                  / report["raw"]["generate_items_per_s"], 3)
    assert report["flow"]["prefect_api"].startswith("http://127.0.0.1:")  # --gpus: the bench's own server
    assert [(p["index"], p["devices"], p["worker"]) for p in fan_out["partitions"]] == [
        (0, "0", None), (1, "1", "bench-gpu1")]  # partition 1 ran on the worker, not taken over
    assert sum(p["processed"] for p in fan_out["partitions"]) == 4
    # each partition's engine ready, from the run's process start, where the manifest carries it;
    # the fan-out's own figure is the earliest
    readies = [p["engine_ready_s"] for p in fan_out["partitions"] if p["engine_ready_s"] is not None]
    assert fan_out["engine_ready_s"] <= min(readies, default=fan_out["engine_ready_s"])
    # Each partition's start: the run asked for its child before its own vllm.LLM began (the
    # child's start beside its import and build), and the worker's process began once asked.
    parent, child = fan_out["partitions"]
    assert child["asked_s"] < parent["engine_build_began_s"] < parent["engine_ready_s"]
    assert child["asked_s"] - 0.5 <= child["process_started_s"]
    assert fan_out["ratio_over_flow"]["generate_items_per_s"] == round(
        fan_out["generate_items_per_s"] / report["flow"]["generate_items_per_s"], 3)
    # beside its ideal, the 1-GPU flow's E + G/2 + T, in the JSON and under the table
    flow, ideal = report["flow"], fan_out["ideal"]
    assert ideal["wall_s"] == pytest.approx(flow["wall_s"] - flow["generate_s"] / 2, abs=0.011)
    assert fan_out["ideal_over_wall"] == round(ideal["wall_s"] / fan_out["wall_s"], 3)
    assert f"fan-out on 2 GPUs: wall {fan_out['wall_s']:.2f} s against its ideal" in done.stdout
    workers = [p for p in psutil.process_iter(["cmdline"]) if "bench-gpu1" in " ".join(p.info["cmdline"] or [])]
    assert workers == []
    # no GPU: the processor stays on the CPU in both, and raw runs once
    assert report["raw"]["processor_device"] == report["flow"]["processor_device"] == "cpu"
    assert "raw_same" not in report
    assert report["raw"]["gpu_busy_pct"] is None  # no NVIDIA GPU here: no figure, not a made-up one
    assert report["flow"]["gpu_busy_by_tenth"] == [None] * 10
    for phase in ("raw", "flow"):  # each phase's output, and its GPU samples (none here)
        log = sorted((tmp_path / "bench").glob(f"{phase}-*.log"))[0]
        assert json.loads(log.with_suffix(".gpu.json").read_text()) == []
    assert len(list((tmp_path / "bench").glob("raw-n[01]-*.log"))) == 2  # each raw process's own output
    assert json.loads(next((tmp_path / "bench").glob("raw-n-*.gpu.json")).read_text()) == []


def test_variants_get_their_own_columns(tmp_path, capsys):
    """`--flow-env` and `--fan-out-env` phases as the table shows them: each its own column with
    its ratio (over raw for a flow variant, over the one-GPU flow for a fan-out variant), and the
    settings as the column's name; `--flow-env` values reach BenchConfig as typed."""
    import argparse

    from vlm_caption.bench.cli import add_bench_arguments
    from vlm_caption.bench.report import print_table

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--flow-env", "VLM_CAPTION_FEED_DEPTH=1,VLM_CAPTION_PREPARE_AHEAD=4",
                              "--fan-out-env", "VLM_CAPTION_PREPARE_AHEAD=4"])
    assert args.flow_env == ["VLM_CAPTION_FEED_DEPTH=1,VLM_CAPTION_PREPARE_AHEAD=4"]
    assert args.fan_out_env == ["VLM_CAPTION_PREPARE_AHEAD=4"]
    phase = lambda rate: {"generate_items_per_s": rate, "wall_s": 10.0}  # noqa: E731
    report = {"config": {"images": 4, "modality": "image", "width": 96, "height": 64}, "device": "cpu",
              "raw": {**phase(2.0), "prompt_tokens": 4000, "cached_prompt_tokens": 3000},
              "flow": phase(3.0), "ratio_flow_over_raw": {"generate_items_per_s": 1.5},
              "flow_env": {args.flow_env[0]: {**phase(4.0), "ratio_over_raw": {"generate_items_per_s": 2.0}}},
              "fan_out": {**phase(5.0), "gpus": 2, "ratio_over_flow": {"generate_items_per_s": 1.667},
                          "partitions": [], "items": 1024, "copies": 768},
              "fan_out_env": {args.fan_out_env[0]: {**phase(4.5), "gpus": 2,
                                                    "ratio_over_flow": {"generate_items_per_s": 1.5}}}}
    print_table(report, tmp_path / "bench.json")
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "metric" in line)
    assert [name.strip() for name in header.strip("┃ ").split("┃")] == [
        "metric", "raw (example's way)", "flow", "flow / raw", args.flow_env[0], "/ raw", "flow on 2 GPUs",
        "/ flow", "2 GPUs, VLM_CAPTION_PREPARE_AHEAD=4", "/ flow"]
    row = next(line for line in out.splitlines() if "generate_items_per_s" in line)
    assert [cell.strip() for cell in row.strip("│ ").split("│")] == [
        "generate_items_per_s", "2.00", "3.00", "1.50", "4.00", "2.00", "5.00", "1.67", "4.50", "1.50"]
    # a phase that captioned same-bytes items once did less than raw, and a raw phase whose prompts vLLM's
    # prefix cache served (repeated media, not a prompt's shared text) did less than its items: said, for those only
    assert [line for line in out.splitlines() if line.startswith("WARNING")] == [
        "WARNING: fan-out took 768 of 1024 answers from items with the same bytes (no request); raw asked each: "
        "its items/s are not raw's work",
        "WARNING: raw took 3000 of its 4000 prompt tokens (75%) from vLLM's prefix cache: its items repeat, and "
        "the engine encoded each once"]
    # a block or two of every prompt's shared text is not a repeat
    report.update(raw={**phase(2.0), "prompt_tokens": 4000, "cached_prompt_tokens": 64}, fan_out_env={})
    del report["fan_out"]
    print_table(report, tmp_path / "bench.json")
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING")]


@pytest.mark.parametrize("modality", ["image", "video", "multi-image"])
def test_each_modality_reaches_raw_as_its_example_builds_it(tmp_path, modality):
    """What the smoke's video run leaves out, without an engine: the bench's items for each
    modality, listed as the flow lists them, decoded for raw as the examples do (a PIL image, a
    group of GROUP_SIZE, sampled frames with their metadata for recipes that need it)."""
    from PIL import Image

    from vlm_caption.bench.config import BenchConfig
    from vlm_caption.bench.media import GROUP_SIZE, bench_items, make_bench_media
    from vlm_caption.bench.phases import example_media

    cfg = BenchConfig(workdir=str(tmp_path), modality=modality, images=3, width=64, height=48, frames=4)
    items = bench_items(cfg, make_bench_media(cfg, tmp_path))
    assert len(items) == 3 and {len(paths) for paths in items} == {GROUP_SIZE if modality == "multi-image" else 1}
    media = example_media(cfg, items[0], needs_metadata=True)
    if modality == "image":
        assert isinstance(media, Image.Image) and media.size == (64, 48)
    elif modality == "multi-image":
        assert [image.size for image in media] == [(64, 48)] * GROUP_SIZE
    else:
        frames, metadata = media
        assert frames.shape[0] == 4 and frames.shape[1:3] == (48, 64) and metadata["total_num_frames"] >= 4


def test_the_profile_is_told_apart_by_process(tmp_path):
    """py-spy's raw output with --subprocesses: each child's stacks under its own process, told
    apart by what it runs (the engine core, the decode pool) and summarized on its own."""
    from vlm_caption.bench.report import profile_summary

    flow = 'process 10:"python -m vlm_caption.bench.phases flow"'
    core = f'{flow};process 11:"python -c from multiprocessing.spawn import spawn_main"'
    (tmp_path / "p.txt").write_text("\n".join([
        f"{flow};thread (10): MainThread;<module> (bench.py:1);phase_flow (bench.py:2);wait (threading.py:3) 30",
        f"{flow};thread (12): feed;step (feed.py:9);add_request (llm_engine.py:5) 5",
        f"{flow};thread (12): feed;step (feed.py:9);_find_and_load (<frozen importlib._bootstrap>:1) 5",
        f"{core};thread (11): MainThread;run_engine_core (vllm/v1/engine/core.py:1);schedule (scheduler.py:7) 60",
        f"{core};thread (11): MainThread;run_engine_core (vllm/v1/engine/core.py:1);"
        f"EngineCore.__init__ (vllm/v1/engine/core.py:90);capture_model (gpu_model_runner.py:4) 20",
        # the decode pool's initializer `_start_worker` is told by its module
        f"{flow};process 13:\"spawn\";thread (13): MainThread;_start_worker (tasks/media/pool.py:58);"
        f"video_loader (tasks/media/video.py:52);_find_and_load (<frozen importlib._bootstrap>:1) 2",
    ]))
    summary = profile_summary(tmp_path / "p.txt")
    assert summary["samples"] == 122
    core_row, flow_row, decode_row = summary["processes"]
    assert decode_row["role"] == "decode pool"
    assert (core_row["role"], core_row["samples"], core_row["share_of_all_pct"]) == ("vllm engine core", 80, 65.6)
    assert core_row["starting_pct"] == 25.0  # the engine's construction (CUDA-graph capture) is start-up
    assert core_row["by_function_pct"] == {"schedule (scheduler.py:7)": 75.0}
    assert flow_row["importing_pct"] == 12.5 and flow_row["by_function_pct"] == {
        "wait (threading.py:3)": 75.0, "add_request (llm_engine.py:5)": 12.5}
    assert flow_row["role"] == "flow" and flow_row["by_thread_pct"] == {"thread (10): MainThread": 75.0,
                                                                         "thread (12): feed": 25.0}


def test_gpu_busy_is_reported_over_the_window_and_each_tenth_of_it():
    """A ramp and a drained tail show in the first and last tenths, not only as a lower mean."""
    from vlm_caption.bench.harness import GpuSampler

    sampler = GpuSampler()
    # 0.2 s samples over 10 s: 50% in the first second, 100% after, 0% in the last second.
    sampler.samples = [(t / 5, 50.0 if t < 5 else 0.0 if t >= 45 else 100.0) for t in range(50)]
    assert sampler.busy_pct(0.0, 9.99) == 85.0
    assert sampler.busy_by_tenth(0.0, 9.99) == [50.0, *[100.0] * 8, 0.0]
    assert sampler.busy_pct(20.0, 30.0) is None  # no samples there: no figure


def test_gpu_busy_is_sampled_on_the_gpus_the_bench_was_given(monkeypatch):
    """NVML numbers every GPU of the host: a bench kept to GPU 1 (CUDA_VISIBLE_DEVICES=1) samples
    GPU 1, not GPU 0, where another bench may be running."""
    from vlm_caption.bench.harness import visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert visible_gpus(1) == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert visible_gpus(2) == [2, 3] and visible_gpus(1) == [2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f2c")  # UUIDs: NVML's order, from the first
    assert visible_gpus(2) == [0, 1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus(2) == [0, 1]


def test_raw_n_processes_are_one_phase_from_the_first_engine_ready_to_the_last_result():
    """Raw, N processes as the report shows it, from each process's times (unix): items/s from
    the first engine ready to the last result, while generating (the first request to the last
    result), each process's own engine-ready time and rate; times from the phase's start."""
    from vlm_caption.bench.driver import raw_n_figures
    from vlm_caption.bench.phases import raw_slice

    assert [raw_slice(list(range(5)), i, 2) for i in range(2)] == [[0, 1], [2, 3, 4]]
    t0 = 1000.0
    proc = {"output_tokens": 30, "processor_device": "cpu", "processor_gpu_peak_mb": None}
    figures = raw_n_figures([{**proc, "items": 10, "engine_ready_at": t0 + 10, "window": [t0 + 12, t0 + 17],
                              "generate_items_per_s": 2.0, "peak_rss_mb": 900.0},
                             {**proc, "items": 10, "engine_ready_at": t0 + 14, "window": [t0 + 15, t0 + 20],
                              "generate_items_per_s": 2.0, "peak_rss_mb": 950.0}], t0, [t0 + 18, t0 + 22])
    assert figures["ready_to_last_items_per_s"] == 20 / 10  # from 10 s to 20 s
    assert figures["generate_items_per_s"] == 20 / 8 and figures["summed_gpu_items_per_s"] == 4.0
    assert (figures["engine_ready_s"], figures["first_result_s"], figures["wall_s"]) == (10.0, 17.0, 22.0)
    assert figures["window"] == [t0 + 12, t0 + 20] and figures["peak_rss_mb"] == 950.0
    assert [(p["engine_ready_s"], p["generate_window_s"], p["wall_s"]) for p in figures["processes"]] == [
        (10.0, [12.0, 17.0], 18.0), (14.0, [15.0, 20.0], 22.0)]


def test_a_fan_outs_first_engine_and_last_result_come_from_its_partitions():
    """The earliest engine ready of the run's own and its partitions' (a partition's report may
    lack it), the latest result of the run's window and its partitions'."""
    from vlm_caption.bench.report import engine_ready_gaps
    from vlm_caption.bench.phases import first_ready_last_result

    briefs = [{"engine_ready_at": 5.0, "generate_to": 9.0}, {"engine_ready_at": 3.0, "generate_to": 11.0}, {}]
    assert first_ready_last_result({"ready_at": 5.0}, [6.0, 9.0], briefs) == (3.0, 11.0)
    assert first_ready_last_result({}, [0.0, 0.0], []) == (None, None)
    report = {"raw": {"engine_ready_s": 9.0}, "flow": {"engine_ready_s": 15.5}, "fan_out": {"engine_ready_s": 16.0},
              "raw_n": {"engine_ready_s": 10.0}}
    assert engine_ready_gaps(report) == {"flow_minus_raw": 6.5, "fan_out_minus_raw_n": 6.0}
    assert engine_ready_gaps({"raw": {}, "flow": {"engine_ready_s": 15.5}}) == {}
    # With raw on the flow's processor device: the gap to it, and how much came before vllm.LLM
    # began (each phase's ready time less its build, engine_start_s).
    report = {"raw": {"engine_ready_s": 53.8, "engine_start_s": 30.0}, "raw_same": {"engine_ready_s": 39.4,
              "engine_start_s": 20.4}, "flow": {"engine_ready_s": 45.1, "engine_start_s": 21.1}}
    assert engine_ready_gaps(report) == {"flow_minus_raw": -8.7, "flow_minus_raw_same": 5.7,
                                         "flow_minus_raw_before_build": 5.0}


@pytest.mark.parametrize(("flags", "skip_raw", "skip_raw_n"), [
    ([], False, False), (["--skip-raw"], True, False), (["--skip-raw-n"], False, True),
    (["--skip-raw-n", "--skip-raw"], True, True)])
def test_skip_raw_and_skip_raw_n_reach_the_config(flags, skip_raw, skip_raw_n):
    """`--skip-raw` leaves out raw on one GPU, `--skip-raw-n` raw, N processes; both reach
    BenchConfig through the one `skip_raw` value `vlm-caption bench` hands it."""
    import argparse

    from vlm_caption.bench.cli import add_bench_arguments
    from vlm_caption.bench.config import BenchConfig

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args([*flags, "--gpus", "2"])
    cfg = BenchConfig(workdir="bench", gpus=args.gpus, skip_raw=args.skip_raw)
    assert (cfg.skip_raw, cfg.skip_raw_n, cfg.runs_raw_n()) == (skip_raw, skip_raw_n, not skip_raw_n)
    assert not BenchConfig(workdir="bench").runs_raw_n()  # one GPU: no raw, N processes


def test_a_warm_up_runs_raw_over_a_few_items_before_every_compared_phase(tmp_path, monkeypatch, capsys):
    """`--warm-up`: raw over the first WARM_UP_ITEMS items runs before raw, and the flow over as
    many before the flow's phases (vLLM compiles and caches kernels by the engine's arguments,
    which are not raw's), so each finds the host's kernels compiled; their figures are kept apart
    as `warm_up` and `flow_warm_up` and printed as not compared; without the flag no such phase runs. Without an engine: each phase's process is
    stood in for."""
    import argparse
    import contextlib

    from vlm_caption.bench import driver, phases
    from vlm_caption.bench.cli import add_bench_arguments
    from vlm_caption.bench.config import RESULT_FILE, WARM_UP_ITEMS, BenchConfig

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    assert parser.parse_args(["--warm-up"]).warm_up and not parser.parse_args([]).warm_up
    ran = []

    def fake_phase(phase, cfg, folder, model, *args, **kwargs):
        ran.append(phase)
        return {"items": WARM_UP_ITEMS if "warm-up" in phase else cfg.images, "engine_ready_s": 9.0,
                "wall_s": 12.0, "generate_items_per_s": 2.0}

    monkeypatch.setattr(driver, "run_phase", fake_phase)
    monkeypatch.setattr(driver, "prefect_api", lambda *a: contextlib.nullcontext({}))
    monkeypatch.setattr(driver, "make_bench_media", lambda cfg, work: work)
    for warm_up in (True, False):
        ran.clear()
        report = driver.run_bench(BenchConfig(workdir=str(tmp_path), model="m", images=1024, warm_up=warm_up))
        assert ran == (["warm-up", "raw", "flow-warm-up", "flow"] if warm_up else ["raw", "flow"])
        assert ("warm_up" in report) is warm_up and ("flow_warm_up" in report) is warm_up
    # with no raw phase to run, only the flow's kernels are compiled first (minutes of a lent GPU saved)
    for rounds, phases_run in ((0, ["flow-warm-up", "flow"]),
                               (1, ["warm-up", "flow-warm-up", "flow", "start-raw", "start-flow"])):
        ran.clear()
        driver.run_bench(BenchConfig(workdir=str(tmp_path), model="m", images=1024, warm_up=True, skip_raw=True,
                                     start_rounds=rounds))
        assert ran == phases_run
    ran.clear()
    report = driver.run_bench(BenchConfig(workdir=str(tmp_path), model="m", images=1024, warm_up=True))
    assert report["warm_up"] == {"items": WARM_UP_ITEMS, "engine_ready_s": 9.0, "wall_s": 12.0}
    assert report["flow_warm_up"] == {"items": WARM_UP_ITEMS, "engine_ready_s": 9.0, "wall_s": 12.0}
    printed = capsys.readouterr().out
    assert "warm-up (raw, 16 items, not compared): engine ready at 9.00 s" in printed
    assert "warm-up (the flow, 16 items, not compared): engine ready at 9.00 s" in printed
    # the phase's own process takes the first 16 of 1,024 items, as raw takes a slice
    taken = {}
    monkeypatch.setattr(phases, "phase_raw", lambda cfg, folder, model, part=None, **kw: taken.update(part=part) or {})
    monkeypatch.setenv(RESULT_FILE, str(tmp_path / "result.json"))
    monkeypatch.setattr(phases, "_torch_gpu_peak_mb", lambda: None)
    phases.child_main("warm-up", json.dumps({"workdir": str(tmp_path), "images": 1024}), str(tmp_path), "m")
    assert phases.raw_slice(list(range(1024)), *taken["part"]) == list(range(WARM_UP_ITEMS))
    # the flow's warm-up is a run of the flow's own job, stopped after the first 16 items listed
    monkeypatch.setattr(phases, "phase_flow", lambda cfg, folder, model, fan_out=1, limit=None:
                        taken.update(limit=limit, fan_out=fan_out) or {})
    phases.child_main("flow-warm-up", json.dumps({"workdir": str(tmp_path), "images": 1024}), str(tmp_path), "m")
    assert (taken["limit"], taken["fan_out"]) == (WARM_UP_ITEMS, 1)


def test_an_inventory_history_is_what_a_run_counts_as_done(prefect_api, s3_endpoint, s3_client, tiny_llava,
                                                           tmp_path, monkeypatch):
    """`--history-source inventory`: the report the bench writes lists the history, a run over it
    finds every item done (no engine), and the night's new items (in the bucket, in the next day's
    report) are the only ones captioned; `--history-keep` finds the history again, as it was."""
    import vlm_caption.tasks.engine.vllm_engine as vllm_engine
    from vlm_caption.bench.config import BenchConfig
    from vlm_caption.bench.history import HISTORY_RUN, add_new_items, synthesize
    from vlm_caption.bench.history_inventory import InventoryLocations, kept_history
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob

    s3_client.create_bucket(Bucket="bench")  # where the report's items are (bench/history_inventory.py)
    cfg = BenchConfig(workdir=str(tmp_path), history=200, shard_size=8, max_tokens=4, history_source="inventory")
    where = InventoryLocations(tmp_path / "history", "folder")
    new = synthesize(where, cfg, str(tiny_llava), {})
    job = CaptionJob(source=where.source, source_format="inventory", output=where.out, model=str(tiny_llava),
                     shard_size=8, sampling={"max_tokens": 4})

    def no_engine(spec):
        raise AssertionError("a run with nothing new built an engine")

    monkeypatch.setattr(vllm_engine, "_engine_for", no_engine)
    summary = vlm_caption(job)
    assert (summary["listed"], summary["skipped_already_done"], summary["processed"]) == (200, 200, 0)

    monkeypatch.undo()
    add_new_items(where, new, {})
    summary = vlm_caption(job)
    assert (summary["listed"], summary["skipped_already_done"], summary["succeeded"]) == (202, 200, 2)
    records = [r for r in result_files.records(where.base / "out") if r["run_id"] == summary["run_id"]]
    assert sorted(r["key"] for r in records) == sorted(new)
    assert all(r["error"] is None and r.get("duplicate_of") is None for r in records)  # each its own bytes

    # Kept: the next bench removes what the runs added and finds the 200 done again.
    marker = {"history": 200, "run": HISTORY_RUN}
    (where.base / "synthesized.json").write_text(json.dumps({**marker, "compacted": where.compacted}))
    assert kept_history(where.base, marker)
    assert [p.name for p in result_files.parquet_files(where.base / "out")] == [f"run-{HISTORY_RUN}.parquet"]
    assert not (where.base / "inventory" / "bench" / "nightly" / "2026-01-02T00-00Z").exists()
    monkeypatch.setattr(vllm_engine, "_engine_for", no_engine)
    summary = vlm_caption(job)
    assert (summary["listed"], summary["skipped_already_done"], summary["processed"]) == (200, 200, 0)


def test_bench_clips_stay_distinct_past_256(tmp_path):
    """The flow captions identical bytes once, so a bench whose clips repeated would measure a
    quarter of the work at 1,024 clips (it did: clip i + 256 was clip i until the top blocks)."""
    import hashlib

    from vlm_caption.bench.media import make_bench_videos

    folder = make_bench_videos(tmp_path / "clips", 513, 64, 48, 1)
    digests = {hashlib.sha256(path.read_bytes()).hexdigest() for path in folder.glob("clip-*.mp4")}
    assert len(digests) == 513
    # a working folder an older bench filled (clip 256 a copy of clip 0) is made right, not reused
    (folder / "clip-000256.mp4").write_bytes((folder / "clip-000000.mp4").read_bytes())
    (folder / "clip-000300.mp4").write_bytes((folder / "clip-000044.mp4").read_bytes())
    make_bench_videos(folder, 513, 64, 48, 1)
    assert len({hashlib.sha256(path.read_bytes()).hexdigest() for path in folder.glob("clip-*.mp4")}) == 513


def test_start_rounds_alternate_and_report_the_median_gap(tmp_path, monkeypatch, capsys):
    """`--start-rounds N`: after the compared phases, N pairs of raw (with the flow's processor
    device) and the flow over 16 items, the first of each pair alternating; each round's
    engine-ready gap split at `vllm.LLM`'s start, the medians printed and written."""
    import contextlib

    from vlm_caption import bench
    from vlm_caption.bench import driver, phases
    from vlm_caption.bench.cli import cmd_bench
    from vlm_caption.bench.config import RESULT_FILE, WARM_UP_ITEMS, BenchConfig
    from vlm_caption.flows.cli import build_parser

    given = []  # what `vlm-caption bench --start-rounds 3` hands the bench
    monkeypatch.setattr(bench, "run_bench", given.append)
    cmd_bench(build_parser().parse_args(["bench", "--start-rounds", "3"]))
    assert given[0].start_rounds == 3
    ran, flow_ready = [], iter([30.0, 24.0, 50.0])  # the gaps: +10, +4, +30 (one host hiccup)

    def fake_phase(phase, cfg, folder, model, *args, **kwargs):
        ran.append(phase)
        ready = next(flow_ready) if phase == "start-flow" else 20.0
        return {"items": cfg.images, "engine_ready_s": ready, "engine_start_s": 10.0 if phase == "start-raw" else 12.0,
                "wall_s": 60.0, "generate_items_per_s": 2.0}

    monkeypatch.setattr(driver, "run_phase", fake_phase)
    monkeypatch.setattr(driver, "prefect_api", lambda *a: contextlib.nullcontext({}))
    monkeypatch.setattr(driver, "make_bench_media", lambda cfg, work: work)
    report = driver.run_bench(BenchConfig(workdir=str(tmp_path), model="m", images=1024, start_rounds=3))
    assert ran == ["raw", "flow", "start-raw", "start-flow", "start-flow", "start-raw", "start-raw", "start-flow"]
    rounds = report["start_rounds"]
    assert [r["gaps"]["ready"] for r in rounds["rounds"]] == [10.0, 4.0, 30.0]
    assert rounds["median"] == {"ready": 10.0, "before_build": 8.0, "build": 2.0}
    assert json.loads((tmp_path / "bench.json").read_text())["start_rounds"] == rounds
    assert ("engine ready, flow less raw with its processor, median of 3 rounds: +10.00 s (+8.00 s before "
            "vllm.LLM began, +2.00 s in its build); each round: +10.00, +4.00, +30.00 s") in capsys.readouterr().out
    # each round's raw: the first 16 items with the flow's processor device; its flow: the flow's job, 16 items
    taken = {}
    monkeypatch.setattr(phases, "phase_raw", lambda cfg, folder, model, part=None, processor_device="cpu":
                        taken.update(part=part, device=processor_device) or {})
    monkeypatch.setattr(phases, "phase_flow", lambda cfg, folder, model, fan_out=1, limit=None:
                        taken.update(limit=limit) or {})
    monkeypatch.setenv(RESULT_FILE, str(tmp_path / "result.json"))
    monkeypatch.setattr(phases, "_torch_gpu_peak_mb", lambda: None)
    config = json.dumps({"workdir": str(tmp_path), "images": 1024, "processor_device": "cuda"})
    phases.child_main("start-raw", config, str(tmp_path), "m")
    phases.child_main("start-flow", config, str(tmp_path), "m")
    assert phases.raw_slice(list(range(1024)), *taken["part"]) == list(range(WARM_UP_ITEMS))
    assert (taken["device"], taken["limit"]) == ("cuda", WARM_UP_ITEMS)


def test_a_historys_new_items_sort_among_the_done_ones_or_after_them(monkeypatch):
    """`--history-new-at end`: the night's new items sort after every done one (a bucket whose
    keys begin with the day), so a rerun's listing reaches them last; by default they are spread
    among them, the first right after the first done item."""
    from vlm_caption import bench
    from vlm_caption.bench.cli import cmd_bench
    from vlm_caption.bench.history import Locations, item_key, new_keys
    from vlm_caption.flows.cli import build_parser

    given = []
    monkeypatch.setattr(bench, "run_bench", given.append)
    cmd_bench(build_parser().parse_args(["bench", "--history", "1000", "--history-new-at", "end"]))
    assert (given[0].history, given[0].history_new_at) == (1000, "end")
    done = [item_key(i) for i in range(20_000)]
    where = Locations(Path("history"), "folder")
    at_end, spread = new_keys(where, 20_000, "end"), new_keys(where, 20_000)
    assert len(at_end) == len(spread) == 200 and not set(at_end) & set(done)
    assert sorted(done + at_end)[len(done):] == sorted(at_end)
    listed = sorted(done + spread)
    assert listed.index(spread[0]) == 1 and listed.index(spread[-1]) < len(listed) - 1


def test_also_gpus_fans_out_again_over_fewer_gpus_against_the_same_one_gpu_flow(tmp_path, monkeypatch, capsys):
    """`--gpus 4 --also-gpus 2`: the 1-GPU flow once, then the fan-out over 4 GPUs and over 2, each
    phase's process told its own GPU count, its workers started for it, each put over the same flow
    and shown in its own column with its partitions; an M that is not fewer GPUs is refused first."""
    import argparse
    import contextlib

    from vlm_caption.bench import driver
    from vlm_caption.bench.cli import add_bench_arguments
    from vlm_caption.bench.config import BenchConfig

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    assert parser.parse_args(["--also-gpus", "2", "--also-gpus", "3"]).also_gpus == [2, 3]
    ran, workers = [], []

    def fake_phase(phase, cfg, folder, model, *args, **kwargs):
        ran.append((phase, cfg.gpus))
        rate = {"flow": 40.0, "fan-out": 40.0 * cfg.gpus}[phase]
        return {"items": cfg.images, "engine_ready_s": 50.0, "wall_s": 100.0, "generate_items_per_s": rate,
                "partitions": [{"index": i, "devices": str(i), "worker": None, "processed": 1, "engine_ready_s": 50.0,
                                "generate_window_s": [50.0, 99.0], "generate_items_per_s": 40.0}
                               for i in range(cfg.gpus)] if phase == "fan-out" else []}

    @contextlib.contextmanager
    def fake_workers(gpus, work, env):
        workers.append(gpus)
        yield

    monkeypatch.setattr(driver, "run_phase", fake_phase)
    monkeypatch.setattr(driver, "partition_workers", fake_workers)
    monkeypatch.setattr(driver, "prefect_api", lambda *a: contextlib.nullcontext({}))
    monkeypatch.setattr(driver, "make_bench_media", lambda cfg, work: work)
    report = driver.run_bench(BenchConfig(workdir=str(tmp_path), model="m", images=10240, gpus=4, also_gpus=(2,),
                                          skip_raw="raw,raw-n"))
    assert ran == [("flow", 4), ("fan-out", 4), ("fan-out", 2)] and workers == [4, 2]
    assert report["fan_out"]["ratio_over_flow"]["generate_items_per_s"] == 4.0
    assert report["fan_out_gpus"]["2"]["ratio_over_flow"]["generate_items_per_s"] == 2.0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "metric" in line)
    assert [name.strip() for name in header.strip("┃ ").split("┃")][-4:] == [
        "flow on 4 GPUs", "/ flow", "flow on 2 GPUs", "/ flow"]
    assert [line.split(",")[0] for line in out.splitlines() if ", partition " in line] == ["4 GPUs"] * 4 + ["2 GPUs"] * 2
    with pytest.raises(SystemExit, match="1 < M < 4"):
        driver.run_bench(BenchConfig(workdir=str(tmp_path), model="m", gpus=4, also_gpus=(4,)))


def test_the_flow_phase_starts_prefect_before_the_engine_as_run_does(monkeypatch, tmp_path):
    """The flow phase takes `run`'s order: the plan, Prefect's import, then vLLM's and the engine's
    build on its thread. Prefect imported by the flow's module while the engine's thread imported
    parts of it left one of its modules half-made ("Failed to initialize plugins" in every GPU
    flow phase's log)."""
    from vlm_caption.bench import phases
    from vlm_caption.bench.config import BenchConfig
    from vlm_caption.flows import caption, cli, plan

    order = []

    class Stop(Exception):
        pass

    monkeypatch.setattr(plan, "make_plan", lambda job: order.append("plan") or SimpleNamespace(job=job))
    monkeypatch.setattr(cli, "start_prefect", lambda: order.append("prefect"))
    monkeypatch.setattr(plan, "start_engine_first", lambda run_plan: order.append("engine"))
    monkeypatch.setattr(caption, "vlm_caption", lambda job: (_ for _ in ()).throw(Stop()))
    (tmp_path / "images").mkdir()
    with pytest.raises(Stop):
        phases.phase_flow(BenchConfig(workdir=str(tmp_path)), tmp_path / "images", str(tmp_path / "model"))
    assert order == ["plan", "prefect", "engine"]
