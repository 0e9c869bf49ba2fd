"""`vlm-caption demo` as a new user runs it: offline, tiny random checkpoint, CPU build of vLLM,
a Prefect home that has never been used, on a machine that is busy with other work."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from vlm_caption.flows import cli
from tests.pages import gallery_items
from tests.result_files import records as result_records
from tests.terminal_io import assert_quiet_terminal

# Two processes that spin for at most 15 minutes: the 2-core machine is busy while the
# embedded Prefect server creates its fresh database (which took over Prefect's 20 s default).
BUSY = "import time\nend = time.time() + 900\nwhile time.time() < end:\n    pass\n"
# The load stops once the demo's flow run has begun: Prefect logs this after the embedded server
# has migrated its fresh database and answered the run's creation, which is the start this test
# loads. Spinning through the rest (the engine's start and the run) starved the other xdist
# worker of a 2-core CI machine for ~2 min and showed nothing more.
SERVER_UP = "Beginning flow run"


def _wait_for_the_server_or_the_end(demo: subprocess.Popen, logs: Path, timeout: float) -> None:
    """Until the run's log (the demo's quiet terminal writes Prefect's lines there) says the flow
    run began, or the demo ended, or `timeout` passed."""
    deadline = time.time() + timeout
    while time.time() < deadline and demo.poll() is None:
        if any(SERVER_UP in log.read_text(errors="replace") for log in logs.glob("run-*.log")):
            return
        time.sleep(0.5)


def _stop(load: list[subprocess.Popen]) -> None:
    for proc in load:
        proc.kill()
        proc.wait()


def test_demo_first_run_on_a_busy_machine_with_a_fresh_prefect_home(tmp_path):
    exe = Path(sys.executable).with_name("vlm-caption")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PREFECT_API_URL", "PREFECT_SERVER_EPHEMERAL"))}
    env.update({"HF_HUB_OFFLINE": "1", "PREFECT_HOME": str(tmp_path / "fresh-prefect-home")})
    load = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)]
    try:
        with open(tmp_path / "demo.out", "w") as out, open(tmp_path / "demo.err", "w") as err:
            demo = subprocess.Popen([str(exe), "demo", "--dir", str(tmp_path / "demo"), "--images", "3"],
                                    stdout=out, stderr=err, env=env)
            try:
                _wait_for_the_server_or_the_end(demo, tmp_path / "demo" / "captions" / "logs", timeout=900)
                _stop(load)
                demo.wait(timeout=1200)
            finally:
                if demo.poll() is None:
                    demo.kill()
                    demo.wait()
    finally:
        _stop(load)
    done = subprocess.CompletedProcess(demo.args, demo.returncode, (tmp_path / "demo.out").read_text(),
                                       (tmp_path / "demo.err").read_text())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANDOM-WEIGHT" in done.stdout and "CAPTIONS ARE NOISE" in done.stdout
    results = tmp_path / "demo" / "captions" / "parquet"
    records = result_records(tmp_path / "demo" / "captions")
    assert sorted(r["key"] for r in records) == ["sample-00.jpg", "sample-01.png", "sample-02.webp"]
    assert all(r["error"] is None and r["output_tokens"] > 0 for r in records)
    # The summary after "run finished": where the images came from, where the results are, once each.
    end = done.stdout[done.stdout.index("vlm-caption: run finished"):]
    assert f"  source   {tmp_path / 'demo' / 'images'}\n" in end and f"  results  {results}/" in end, end
    assert "parquet/parquet" not in done.stdout and "images:" not in done.stdout
    # Through a pipe (CI, `| tee`): plain progress lines and the summary; the rest in the log file.
    assert "vlm-caption: 3/3 items" in done.stderr
    assert "s  starting Prefect" in done.stderr and "s  building the engine" in done.stderr, done.stderr  # as `run`
    assert_quiet_terminal(done.stdout + done.stderr, tmp_path / "demo" / "captions", items=3)
    manifest = json.loads(next((tmp_path / "demo" / "captions" / "manifests").glob("*.json")).read_text())
    assert manifest["counts"]["succeeded"] == 3
    # The gallery the demo prints: every item, each with its thumbnail.
    gallery = tmp_path / "demo" / "captions" / "manifests" / f"{manifest['run_id']}.html"
    assert f"gallery  {gallery}" in done.stdout or str(gallery) in done.stdout, done.stdout
    shown = gallery_items(gallery.read_text())
    assert shown == {key: "thumb" for key in ("sample-00.jpg", "sample-01.png", "sample-02.webp")}
    assert manifest["gallery"]["items"] == 3
    assert [p.name for p in results.iterdir()] == [f"run-{manifest['run_id']}.parquet"]  # the parts' folder gone too

    # The demo again: its images kept, so nothing is new; no engine is built, and the captions the
    # first run wrote are shown again.
    again = subprocess.run([str(exe), "demo", "--dir", str(tmp_path / "demo"), "--images", "3"], env=env,
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 captioned: 0 ok, 0 failed; 3 already done" in again.stdout, again.stdout
    assert "building the engine" not in again.stderr and "loading vLLM" not in again.stderr, again.stderr
    assert all(f"  {key}: " in again.stdout for key in ("sample-00.jpg", "sample-01.png", "sample-02.webp"))
    assert len(result_records(tmp_path / "demo" / "captions")) == 3


def test_a_slow_embedded_server_gets_a_message_that_says_what_to_do(monkeypatch, capsys, tmp_path):
    def server_never_came_up(job):
        raise RuntimeError("Timed out while attempting to connect to ephemeral Prefect API server.")

    import vlm_caption.flows.caption as _loaded  # noqa: F401 - binds no name `vlm_caption` (the flow has it)

    from vlm_caption import flows
    monkeypatch.setattr(flows.caption, "vlm_caption", server_never_came_up)
    monkeypatch.setattr("vlm_caption.flows.plan.start_engine_first", lambda plan, **how: False)  # no model here
    code = cli.main(["run", str(tmp_path), "--out", str(tmp_path / "out"), "--skip-model-check"])
    assert code == 3
    err = capsys.readouterr().err
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in err and "vlm-caption server" in err


def test_the_embedded_server_gets_a_generous_start_up_timeout_unless_the_user_set_one():
    """As `run` and `demo` set it, before Prefect is imported (flows/cli.py)."""
    probe = ("from vlm_caption.tasks.prefect_api import embedded_server_defaults\nwith embedded_server_defaults():\n"
             "    import prefect.settings as s; print(s.PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_SERVER_EPHEMERAL")}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) >= 300
    mine = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                          env={**env, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "45"})
    assert mine.stdout.strip() == "45"


def test_a_bad_job_is_one_line_per_mistake_without_pydantic_noise(capsys, tmp_path):
    code = cli.main(["run", str(tmp_path), "--out", str(tmp_path / "out"), "--recipe", "lava"])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'lava'" in err and "Did you mean: llava" in err
    # pydantic's echo of every job field and its documentation link say nothing to the user
    assert "input_value" not in err and "errors.pydantic.dev" not in err and "Value error," not in err
    code = cli.main(["run", str(tmp_path), "--out", str(tmp_path / "out"), "--modality", "video"])
    assert code == 2
    assert "recipe 'llava' does not support modality 'video'; it supports: image, multi-image" in capsys.readouterr().err


def test_a_demo_it_cannot_make_is_one_line_and_exit_2_before_anything_is_made(capsys, tmp_path):
    for flags, says in ((["--modality", "video"], "the demo makes images; run videos or groups with `vlm-caption run`"),
                        (["--recipe", "qwen2_vl"], "--model is required with a recipe other than llava")):
        assert cli.main(["demo", "--dir", str(tmp_path / "demo"), *flags]) == 2
        assert capsys.readouterr().err == f"vlm-caption: error: {says}\n"
    assert not (tmp_path / "demo").exists()


def test_the_progress_label_keeps_the_end_of_a_long_source():
    """A long source path in the bar's label keeps its end (which folder), not its start."""
    from vlm_caption.tasks.terminal import _fit

    assert _fit("Captioning /tmp/nc/repo/vlm-caption-demo/images", 26) == "Captioning …on-demo/images"
    assert _fit("Captioning s3://b/x/", 26) == "Captioning s3://b/x/"
