"""Two runs of the same job never duplicate records: a Prefect global concurrency limit named
after the job's fingerprint makes the second wait for the first (then skip what it did), and a
run that waits too long stops with a message that says what to do."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.params import CaptionJob
from vlm_caption.tasks.concurrency import JobBusyError, one_run_per_job
from tests.images import image_bytes
from tests.result_files import records as result_records


def test_two_runs_of_one_job_started_together(prefect_api, tiny_llava, tmp_path, monkeypatch):
    source, out = tmp_path / "img", tmp_path / "out"
    source.mkdir()
    for i in range(12):
        (source / f"{i:02d}.png").write_bytes(image_bytes("PNG", size=(60 + i, 40), color=(i * 20, 0, 90)))
    job = CaptionJob(source=str(source), output=str(out), model=str(tiny_llava), shard_size=3,
                     sampling={"max_tokens": 4})
    summaries: list[dict] = []
    runs = [threading.Thread(target=lambda: summaries.append(vlm_caption(job))) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(timeout=900)
    assert len(summaries) == 2
    records = result_records(out)
    assert Counter(r["key"] for r in records) == Counter(f"{i:02d}.png" for i in range(12))  # none twice
    assert sorted(s["processed"] for s in summaries) == [0, 12]  # the second found it all done

    # While a run holds the job, another one waits, then gives up with a message. The holder may
    # wait for its slot as long as a busy machine needs; only the second run's wait is short.
    from vlm_caption.tasks.settings import get_settings

    def job_wait(seconds: str) -> None:
        monkeypatch.setenv("VLM_CAPTION_JOB_WAIT_S", seconds)
        get_settings.cache_clear()

    try:
        job_wait("300")
        with one_run_per_job(summaries[0]["fingerprint"], str(out)):
            job_wait("2")
            with pytest.raises(JobBusyError, match="another run of this job .* Wait for it, then run again"):
                vlm_caption(job)
    finally:
        get_settings.cache_clear()


_HOLD_AND_DIE = """
import os, signal, sys
from vlm_caption.tasks.concurrency import one_run_per_job
with one_run_per_job("deadbeef", "/out"):
    children = [p.name for p in __import__("pathlib").Path("/proc").iterdir() if p.name.isdigit()
                and open(f"/proc/{p.name}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid())]
    open(sys.argv[1], "w").write(" ".join(children))  # the embedded server, to stop it afterwards
    os.kill(os.getpid(), signal.SIGKILL)  # killed while holding the job's slot
"""

_TAKE = """
import time
from vlm_caption.tasks.concurrency import one_run_per_job
started = time.time()
with one_run_per_job("deadbeef", "/out"):
    print(f"TOOK-SLOT {time.time() - started:.1f}")
"""


def test_a_run_killed_on_the_embedded_server_does_not_keep_the_job_forever(tmp_path):
    """Without PREFECT_API_URL each process runs its own embedded server: no service expires the
    dead run's lease, so the next run frees the slot of a process that is gone."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from vlm_caption.tasks.prefect_api import EMBEDDED_SERVER_DEFAULTS

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "home"), VLM_CAPTION_JOB_WAIT_S="120", PYTHONUNBUFFERED="1")
    # These scripts call the library, not `vlm-caption run`, which would set the embedded server's
    # defaults (tasks/prefect_api.py): Prefect's own 20 s for its start fails on a loaded machine.
    env.update({name: value for name, value in EMBEDDED_SERVER_DEFAULTS.items() if name not in env})
    root = Path(__file__).resolve().parents[1]
    children = tmp_path / "children"
    first = subprocess.run([sys.executable, "-c", _HOLD_AND_DIE, str(children)], env=env, cwd=root,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    for pid in children.read_text().split():  # the dead run's orphaned embedded server
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert first.returncode == -signal.SIGKILL
    assert list((tmp_path / "home" / "vlm-caption-slots").glob("*.lock"))  # it died holding the slot
    second = subprocess.run([sys.executable, "-c", _TAKE], env=env, cwd=root, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    # Not after the 120 s wait, let alone forever: it took the slot without waiting for anyone.
    assert "TOOK-SLOT" in second.stdout
    assert "the run that held it is gone" in second.stdout + second.stderr
    assert "waiting for another run of this job" not in second.stdout + second.stderr


_HOLD = """
import sys, time
from vlm_caption.tasks.concurrency import hold_job_lock
hold_job_lock("deadbeef", "/out", print)
print("HOLDING", flush=True)
time.sleep(120)
"""


def test_a_second_run_says_whom_it_waits_for_and_starts_nothing(tmp_path, monkeypatch):
    """`vlm-caption run` takes the job's lock before it starts a server or an engine: a second run
    of the job says at once which process it waits for, and gives up with that in its error;
    the lock needs no Prefect server."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from vlm_caption.tasks import concurrency
    from vlm_caption.tasks.settings import get_settings

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "home"))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD], env=env, cwd=Path(__file__).resolve().parents[1],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "HOLDING"
        monkeypatch.setenv("VLM_CAPTION_JOB_WAIT_S", "2")
        get_settings.cache_clear()
        said: list[str] = []
        with temporary_settings(updates={PREFECT_HOME: str(tmp_path / "home")}, restore_defaults={PREFECT_API_URL}):
            with pytest.raises(JobBusyError, match=f"pid {holder.pid} since"):
                concurrency.hold_job_lock("deadbeef", "/out", said.append)
            assert len(said) == 1 and said[0].startswith(f"waiting for another run of this job (pid {holder.pid} since")
            assert "Ctrl-C to stop waiting" in said[0]
            holder.kill()
            holder.wait()
            # The holder gone (killed), the lock is free at once.
            concurrency.hold_job_lock("deadbeef", "/out", said.append)
            assert concurrency.lease_name("deadbeef") in concurrency._held and len(said) == 1
            os.close(concurrency._held.pop(concurrency.lease_name("deadbeef")))
    finally:
        holder.kill()
        holder.wait()
        get_settings.cache_clear()
