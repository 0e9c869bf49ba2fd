"""A run killed at any moment leaves nothing stuck and nothing missing: `vlm-caption run` on the
embedded server (no PREFECT_API_URL), its whole process group killed with SIGKILL at five points of
its run (before its first part, between two parts, between its last part and its manifest, between
its manifest and the Parquet step, just after "run finished"), each time with new images added,
then run once more to its end. Every run after a kill takes the job's slot at once (the dead run's
is freed), and in the end every image is captioned once and the Parquet view read as one dataset
holds exactly the done-index's results, with a manifest that says so. No step by hand."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.dataset as pads

from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.results.done_rows import load_rows, record_row
from vlm_caption.tasks.results.layout import parts_prefix
from vlm_caption.tasks.sources.storage import open_storage
from tests.images import image_bytes
from tests.result_files import records as result_records

ROOT = Path(__file__).resolve().parents[1]

# The run, with one step of it made to kill the run's process group (the process, the embedded
# server it started, the engine's processes) the moment it is reached: a kill at that instruction.
_KILLED_AT = r"""
import os, signal, sys
point, argv = sys.argv[1], sys.argv[2:]

def die(*args, **kwargs):
    os.killpg(0, signal.SIGKILL)

import vlm_caption.flows.caption as caption
import vlm_caption.flows.batches as writers

if point == "before-first-part":
    writers.write_shard = die
elif point == "between-parts":  # the shards write side by side: the kill waits for the first part to land
    import threading
    write, calls, landed = writers.write_shard, [], threading.Event()
    def second_dies(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            landed.wait(120)
            die()
        try:
            return write(*args, **kwargs)
        finally:
            landed.set()
    writers.write_shard = second_dies
elif point == "before-manifest":
    caption.write_manifest = die
elif point == "before-parquet":
    caption.export_after_run = die
elif point == "after-run-finished":
    run = caption.caption_job
    def then_die(*args, **kwargs):
        run(*args, **kwargs)
        die()
    caption.caption_job = then_die
from vlm_caption.flows.cli import main
sys.exit(main(argv))
"""

POINTS = ["before-first-part", "between-parts", "before-manifest", "before-parquet", "after-run-finished"]


def _run(point: str, args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _KILLED_AT, point, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, start_new_session=True)  # a group of its own to kill


def _events(result: subprocess.CompletedProcess) -> list[dict]:
    events = []
    for line in (result.stdout + result.stderr).splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                pass  # a line of another program's that happens to start with a brace
    return events


def test_a_run_killed_at_any_point_is_made_whole_by_the_next(tiny_llava, tmp_path):
    source, output = tmp_path / "photos", tmp_path / "out"
    source.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # the embedded server
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PYTHONUNBUFFERED="1", VLM_CAPTION_JOB_WAIT_S="300")
    args = ["run", str(source), "--model", str(tiny_llava), "--out", str(output), "--shard-size", "1",
            "--max-tokens", "4", "--log-format", "json"]
    added = 0
    for number, point in enumerate([*POINTS, "to-the-end"]):
        for _ in range(2):  # new work for every run, so each reaches the point it is killed at
            (source / f"{added:02d}.png").write_bytes(image_bytes("PNG", size=(40 + added, 32), color=(added * 9, 0, 0)))
            added += 1
        result = _run(point, args, env)
        events = [e.get("event") for e in _events(result)]
        if point == "to-the-end":
            assert result.returncode == 0, result.stderr[-3000:]
        else:
            assert result.returncode == -signal.SIGKILL, (point, result.returncode, result.stderr[-3000:])
        if number > 0:  # the run before died holding the job's slot: freed at once, no wait
            assert "freed the job's slot: the run that held it is gone" in events, (point, events[:40])
            assert "waiting for another run of this job" not in events

    records = result_records(output)
    keys = Counter(r["key"] for r in records)
    assert keys == Counter(f"{i:02d}.png" for i in range(added)), keys  # none lost, none twice
    assert all(r["error"] is None for r in records)

    # The Parquet view, read as one dataset, is exactly the records' results, each once, down to its
    # hash columns; it owes no run a file (no part is left unfolded), so the done-index a next run
    # loads is the view's alone.
    fingerprint = records[0]["fingerprint"]
    rows = pads.dataset(str(output / "parquet"), format="parquet").to_table().to_pylist()
    assert sorted(r["key"] for r in rows) == sorted(keys)
    out = open_storage(str(output))
    done = sorted(record_row(ResultRecord.model_validate(r)) for r in records)
    assert len(done) == added
    assert sorted((r["done_key"], r["listed_hash"], r["content_hash"]) for r in rows) == done
    assert not list(out.iter_objects(prefix=parts_prefix(fingerprint)))
    loaded = load_rows(out, fingerprint)
    assert not loaded.unreadable and all(source.key.startswith("parquet/") for source in loaded.sources)
    assert sorted(tuple(row) for source in loaded.sources for row in source.rows.tolist()) == done
    manifests = sorted((json.loads(p.read_text()) for p in output.glob("manifests/*.json")),
                       key=lambda m: m["run_id"].split("-", 1)[1])
    assert manifests[-1]["parquet"]["complete"], manifests[-1]["parquet"]
    # The runs killed after their first part and before their view file, each added by a later run.
    repaired = {run for m in manifests for run in (m.get("parquet") or {}).get("repaired", {})}
    assert len(repaired) == 3, [m.get("parquet") for m in manifests]


_FAILS_WHILE_BUILDING = r"""
import sys, time
import vlm_caption.flows.caption as caption
from vlm_caption.tasks.errors import UserError
from vlm_caption.tasks.engine import vllm_engine

def fails_as_the_engine_builds(*args, **kwargs):
    while not vllm_engine.building():  # the run fails while its engine is being built
        time.sleep(0.05)
    raise UserError("the source went away")
caption.caption_job = fails_as_the_engine_builds
from vlm_caption.flows.cli import main
sys.exit(main())  # as the console script calls it: its arguments from sys.argv
"""


def test_a_run_that_fails_while_its_engine_builds_ends_at_once(tiny_llava, tmp_path):
    """A failed run does not wait for the engine it will not use (its build holds the lock that
    Python's exit waits for: minutes on a busy CPU): one line, the error's exit code, no process
    left behind. The test runs the run in a process group of its own and looks for survivors."""
    import psutil

    source = tmp_path / "photos"
    source.mkdir()
    (source / "a.png").write_bytes(image_bytes("PNG", size=(40, 32)))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    run = subprocess.Popen([sys.executable, "-c", _FAILS_WHILE_BUILDING, "run", str(source), "--model", str(tiny_llava),
                            "--out", str(tmp_path / "out")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 2, err[-3000:]  # a UserError's exit code
        assert "vlm-caption: error: the source went away" in err
        assert "building the engine" in err and "engine ready" not in err  # it did not wait for the build
        deadline = time.monotonic() + 10  # killed processes are reaped by init a moment after the run's end
        while (left := [p for p in psutil.process_iter(["status"]) if _in_group(p, run.pid)
                        and p.info["status"] != psutil.STATUS_ZOMBIE]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, [(p, p.cmdline()) for p in left]  # the engine's process ended with the run
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)


def _in_group(process, group: int) -> bool:
    try:
        return os.getpgid(process.pid) == group
    except (ProcessLookupError, PermissionError):
        return False
