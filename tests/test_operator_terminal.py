"""The operator's path as a person meets it: each user error one line at the terminal with its exit
code (tasks/errors.py), and in Prefect a permanent error that ends the run at once, not retried,
with one line for its message and a meaningful name."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlm_caption.flows import cli

EXE = str(Path(sys.executable).with_name("vlm-caption"))


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[0].startswith("vlm-caption: error: "), lines
    return lines[0]


def test_help_imports_neither_prefect_nor_vllm_nor_torch():
    """`vlm-caption --help` answers at once: none of the heavy libraries is imported for it, nor
    pydantic, the source readers or the bench (each subcommand's options come when it is used)."""
    done = subprocess.run([sys.executable, "-X", "importtime", EXE, "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: vlm-caption"), done.stderr[-3000:]
    imported = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    heavy = [name for name in imported if name.split(".")[0] in ("prefect", "vllm", "torch", "transformers", "pydantic")
             or name.startswith(("vlm_caption.tasks.sources", "vlm_caption.bench"))]
    assert len(imported) > 20 and not heavy, heavy


def test_run_with_nothing_names_the_source_and_the_output_in_one_message(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["run"])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("vlm-caption run: error: ") and "source" in error and "--out" in error, error
    assert "vlm-caption run ./photos --out ./captions" in error  # what to type


def test_bench_with_a_bad_size_is_one_line_and_exit_2():
    done = subprocess.run([EXE, "bench", "--size", "640by480"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--size 640by480: expected WIDTHxHEIGHT" in one_line(done.stderr)


def test_run_with_a_model_that_is_not_there_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "photos").mkdir()
    done = subprocess.run([EXE, "run", str(tmp_path / "photos"), "--out", str(tmp_path / "out"),
                           "--model", str(tmp_path / "no-such-model")],
                          capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                                            "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    assert f"model folder {tmp_path / 'no-such-model'} does not exist" in one_line(done.stderr)


def test_errors_raised_inside_a_run_are_one_line_with_their_kinds_exit_code(capsys):
    from vlm_caption.flows.server import PrefectAPIUnreachable
    from vlm_caption.tasks.concurrency import JobBusyError
    from vlm_caption.tasks.engine.feed import EngineDied
    from vlm_caption.tasks.engine.model_check import ModelError
    from vlm_caption.tasks.fanout import FanOutError
    from vlm_caption.tasks.results.writers import DiskFullError

    cases = {JobBusyError("another run of this job is running"): 4,
             DiskFullError("no space left on the output's disk"): 5,
             EngineDied("the vLLM engine process died"): 6,
             FanOutError("fan_out needs the deployment 'vlm-caption/partition'"): 7,
             ModelError("model folder /x does not exist"): 2,
             PrefectAPIUnreachable("cannot reach the Prefect API"): 3}
    for error, code in cases.items():
        assert cli.report_user_error(error) == code
        assert one_line(capsys.readouterr().err) == f"vlm-caption: error: {error}"
    assert cli.report_user_error(KeyError("a bug")) is None  # a bug keeps its traceback


def test_a_permanent_error_fails_the_run_at_once_without_a_retry(prefect_api, tmp_path):
    """The flow with a retry (as a deployment has it) and a model that is not there: Failed on the
    first attempt, its message the error's one line, the error raised to the caller."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob
    from vlm_caption.tasks.engine.model_check import ModelError

    (tmp_path / "photos").mkdir()
    job = CaptionJob(source=str(tmp_path / "photos"), output=str(tmp_path / "out"),
                     model=str(tmp_path / "no-such-model"))
    started = time.monotonic()
    with pytest.raises(ModelError, match="does not exist"):
        vlm_caption.with_options(retries=1, retry_delay_seconds=300)(job)
    print(f"final after {time.monotonic() - started:.1f} s")
    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=[f"llava · {tmp_path / 'photos'}"])))
        states = [state.name for state in client.read_flow_run_states(run.id)]
    assert run.state.type.value == "FAILED" and run.run_count == 1, (run.state, run.run_count)
    assert "AwaitingRetry" not in states, states
    assert run.state.message.startswith(f"model folder {tmp_path / 'no-such-model'} does not exist")
    assert "\n" not in run.state.message and "Traceback" not in run.state.message


def test_a_run_whose_parameters_do_not_validate_gets_a_name_and_one_line(prefect_api, tmp_path):
    """As a deployment run with a Prefect variable not set: an empty output. The run is named from
    its parameters as given (not Prefect's random name) and its message is one line."""
    from prefect.client.orchestration import get_client

    from vlm_caption.flows.caption import vlm_caption

    state = vlm_caption(job={"source": str(tmp_path), "output": "", "recipe": "llava"}, return_state=True)
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(state.state_details.flow_run_id)
    assert run.name == f"llava · {tmp_path}"
    assert run.state.type.value == "FAILED" and run.state.message == "invalid job: output: empty location"


class _DeafServer:
    """A server process that does not end on SIGINT (stuck in its shutdown): only SIGKILL ends it."""

    def __init__(self):
        self.signals = []

    def send_signal(self, sig):
        self.signals.append(sig)

    def wait(self, timeout=None):
        import signal

        if self.signals[-1] != signal.SIGKILL:
            raise subprocess.TimeoutExpired("prefect server", timeout)
        return -9


def test_a_server_that_does_not_stop_is_killed_and_the_operator_told_why(capsys):
    """`vlm-caption server` stopping: a server deaf to SIGINT is killed after its wait, and the
    pause is explained on stderr rather than passed over in silence."""
    import signal

    from vlm_caption.flows import server

    deaf = _DeafServer()
    assert server._stop(deaf) == -9
    assert deaf.signals == [signal.SIGINT, signal.SIGKILL]
    assert capsys.readouterr().err == "the Prefect server did not stop within 30 s: killing it\n"
