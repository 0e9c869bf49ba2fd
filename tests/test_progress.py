"""The terminal progress of `vlm-caption run`: a live bar on a terminal, plain lines elsewhere."""

from vlm_caption.tasks.observability import Progress
from vlm_caption.tasks.terminal import TerminalProgress


def test_progress_is_plain_lines_when_not_a_terminal(capsys, monkeypatch):
    import vlm_caption.tasks.terminal as terminal

    clock = [100.0]
    monkeypatch.setattr(terminal.time, "monotonic", lambda: clock[0])
    progress = TerminalProgress(10, "Captioning s3://b/ with llava")
    assert progress.bar is None  # pytest captures stderr: not a terminal
    clock[0] = 190.0  # the engine took 90 s to start: the first shard's results come now
    progress.advance(4, 1)
    clock[0] = 190.5  # a shard that was in the engine with the first one: too soon for a rate
    progress.advance(1, 0)
    clock[0] = 200.0
    progress.advance(1, 0)
    clock[0] = 220.0
    progress.advance(4, 0)
    progress.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        # The rate counts from the first result, not the start, once 2 s have passed since
        # it: 2 items in 10 s, 4 left at 0.2 items/s.
        "vlm-caption: 4/10 items · - items/s · ETA - · 1 errors",
        "vlm-caption: 5/10 items · - items/s · ETA - · 1 errors",
        "vlm-caption: 6/10 items · 0.20 items/s · ETA 0:20 · 1 errors",
        "vlm-caption: 10/10 items · 0.20 items/s · ETA 0:00 · 1 errors",
    ]


def test_progress_is_a_live_bar_on_a_terminal(monkeypatch):
    from rich.console import Console

    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    progress = TerminalProgress(5, "Captioning")
    assert progress.bar is not None
    progress.advance(5, 2)
    task = progress.bar.tasks[0]
    assert (task.completed, task.total, task.fields["errors"]) == (5, 5, 2)
    progress.close()


def test_the_progress_artifact_is_updated_at_most_once_a_second_and_at_the_end(monkeypatch):
    import prefect.artifacts

    import vlm_caption.tasks.observability as observability

    clock = [100.0]
    updates = []
    monkeypatch.setattr(observability.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(prefect.artifacts, "create_progress_artifact", lambda **kwargs: "artifact-1")
    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact",
                        lambda artifact_id, progress: updates.append((artifact_id, progress)))
    progress = Progress("Captioning")
    progress.grow(100)
    for shard in range(10):  # ten shards finish within 0.9 s: one update, when 1 s has passed
        clock[0] += 0.09 if shard < 9 else 0.2
        assert progress.advance(10) == 10.0 * (shard + 1)
    assert updates == [("artifact-1", 100.0)]
    progress.close()  # already published: nothing more
    assert updates == [("artifact-1", 100.0)]

    progress = Progress("Captioning")
    progress.grow(4)
    progress.advance(3)  # too soon to publish
    progress.close()  # the last value is always published
    assert updates[-1] == ("artifact-1", 75.0) and len(updates) == 2


def test_a_quiet_run_sends_this_process_and_its_children_to_the_log_and_keeps_the_terminal(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    log = tmp_path / "logs" / "run.log"
    script = f"""
import subprocess, sys
from pathlib import Path
from vlm_caption.tasks.terminal import quiet_terminal, user_stream
with quiet_terminal(Path({str(log)!r})):
    print("a Prefect line")
    print("a warning", file=sys.stderr)
    subprocess.run([sys.executable, "-c", "import sys; print('the engine'); print('its warning', file=sys.stderr)"])
    print("progress 1/1", file=user_stream())
print("the summary")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the summary\n"
    assert done.stderr == f"vlm-caption: the run's log (Prefect, vLLM): {log}\nprogress 1/1\n"
    kept = log.read_text()
    assert all(line in kept for line in ("a Prefect line", "a warning", "the engine", "its warning")), kept
    assert "progress" not in kept


def test_the_summary_says_what_was_done_how_fast_and_where_it_all_is(capsys, tmp_path):
    from vlm_caption.tasks.terminal import print_run_end

    summary = {"processed": 10, "succeeded": 8, "failed": 2, "failed_by_kind": {"bad_input": 1, "engine": 1},
               "skipped_already_done": 5, "items_per_s": 0.5, "wall_s": 20.2, "generate_items_per_s": 2.0,
               "output_tokens_per_s": 128.0, "fingerprint": "abc", "manifest": "s3://b/out/manifests/r.json",
               "gallery": "s3://b/out/manifests/r.html", "parquet": None}
    print_run_end(summary, "s3://b/out/", tmp_path / "run.log", None)
    assert capsys.readouterr().out.splitlines() == [
        "vlm-caption: run finished",
        "  items    10 captioned: 8 ok, 2 failed (bad_input 1, engine 1); 5 already done",
        "  speed    0.50 items/s over 20 s (2.00 while generating, 128 output tokens/s)",
        "  results  s3://b/out/parquet/",
        "  manifest s3://b/out/manifests/r.json",
        "  gallery  s3://b/out/manifests/r.html",
        f"  log      {tmp_path / 'run.log'}",
    ]


def test_a_quiet_run_shuts_its_engine_down_into_the_log(tmp_path):
    """The engine is released inside the redirect: what vLLM says as it ends the engine's
    processes (a force kill under load) goes to the run's log, not the terminal after the summary."""
    import subprocess
    import sys
    from pathlib import Path

    log = tmp_path / "run.log"
    script = f"""
import sys
from pathlib import Path
import vlm_caption.tasks.engine.vllm_engine as engine
from vlm_caption.tasks.terminal import quiet_terminal
engine.release_engines = lambda: print("WARNING vllm.v1.utils - [shutdown] force killing", file=sys.stderr)
with quiet_terminal(Path({str(log)!r})):
    pass
engine.release_engines = lambda: None  # at exit: nothing more
print("the summary")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert "force killing" not in done.stdout + done.stderr and "force killing" in log.read_text()


def test_a_long_label_leaves_the_counts_on_the_line(monkeypatch):
    from rich.console import Console

    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    monkeypatch.setattr(Console, "width", property(lambda self: 120))
    progress = TerminalProgress(3, "Captioning /a/very/long/" + "path/" * 30 + "images with llava")
    label = progress.bar.tasks[0].description  # its first word and the end: which folder, which recipe
    assert len(label) == 40 and label.startswith("Captioning …") and label.endswith("/images with llava")
    progress.close()


def test_a_run_done_within_the_rate_window_ends_with_its_rate_not_a_dash(capsys, monkeypatch):
    """The demo's 24 items come in a few shards that finish together: the last line (and the
    bar) says items/s over the whole progress, engine start included, instead of "-"."""
    from rich.console import Console

    import vlm_caption.tasks.terminal as terminal

    clock = [100.0]
    monkeypatch.setattr(terminal.time, "monotonic", lambda: clock[0])
    progress = TerminalProgress(0, "Captioning")
    progress.grow(24)
    clock[0] = 160.0  # the engine's start, then the first shard
    progress.advance(8, 0)
    clock[0] = 160.5
    progress.advance(16, 0)
    progress.close()
    assert capsys.readouterr().err.strip().splitlines() == [
        "vlm-caption: 8/24 items · - items/s · ETA - · 0 errors",
        "vlm-caption: 24/24 items · 0.40 items/s · ETA 0:00 · 0 errors",  # 24 items in 60 s
    ]

    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    clock[0] = 100.0
    progress = TerminalProgress(24, "Captioning")
    clock[0] = 130.0
    progress.advance(24, 0)
    assert progress.bar.tasks[0].fields["rate"] == "0.80"
    progress.close()


def test_prefects_first_run_notice_goes_to_the_quiet_runs_log(tmp_path):
    """In a terminal, with a Prefect home never used, `import prefect` prints a three-line telemetry
    notice; before a quiet run it is held, written into the run's log, and one line of ours says so."""
    import sys

    from tests.terminal_io import run_in_a_terminal

    log = tmp_path / "logs" / "run.log"
    script = f"""
from pathlib import Path
from vlm_caption.tasks.prefect_api import import_prefect
from vlm_caption.tasks.terminal import quiet_terminal
import_prefect()  # as `vlm-caption run` and `demo` do first: the notice held
import prefect
with quiet_terminal(Path({str(log)!r})):
    pass
print("the summary")
"""
    from tests.test_prefect_api import telemetry_on_with_a_fresh_home

    env = telemetry_on_with_a_fresh_home(tmp_path / "fresh-prefect-home")
    code, screen = run_in_a_terminal([sys.executable, "-c", script], env=env, timeout=120)
    assert code == 0, screen
    assert "anonymous usage data" not in screen and "docs.prefect.io" not in screen, screen
    assert screen.replace("\r\n", "\n").splitlines() == [
        f"vlm-caption: the run's log (Prefect, vLLM): {log}",
        "vlm-caption: Prefect's first-run telemetry notice is in the log (to opt out of Prefect's usage data: "
        "DO_NOT_TRACK=1)",
        "the summary",
    ]
    assert "Prefect collects anonymous usage data" in log.read_text()
    assert (tmp_path / "fresh-prefect-home" / ".sdk_telemetry" / "notice_shown").exists()  # shown once, as Prefect does


def test_items_already_done_count_in_the_artifact_not_in_the_terminals_rate(capsys, monkeypatch):
    """A night with 990 items done and 10 new: the progress artifact goes from 99% to 100% as the
    new ones finish; the terminal's line counts the 10 items of this run's work."""
    import prefect.artifacts

    import vlm_caption.tasks.observability as observability

    clock = [100.0]
    updates = []
    monkeypatch.setattr(observability.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(prefect.artifacts, "create_progress_artifact", lambda **kwargs: "artifact-2")
    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact",
                        lambda artifact_id, progress: updates.append(progress))
    progress = Progress("Captioning")
    clock[0] += 2
    progress.skip(990)  # the listing's done items: not published on their own (new ones may follow)
    progress.grow(10)
    assert updates == [] and progress.percent == 99.0
    clock[0] += 2
    progress.advance(4)
    progress.advance(6)
    progress.close()
    assert updates == [99.4, 100.0]
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split(" · ")[0] for line in lines] == ["vlm-caption: 4/10 items", "vlm-caption: 10/10 items"]
