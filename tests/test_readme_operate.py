"""The README's "Operate it" block as a newcomer pastes it: typed byte for byte, one command at a
time, into an interactive bash on a pseudo-terminal in the repository's root, with a fresh
PREFECT_HOME, no PREFECT_API_URL and the block's own port, 4200. Every command exits 0 with no
question asked, the server's and the worker's output stay in their log files, and the last
command waits for the `dev` run and exits 0 because it Completed. Then the README's way to stop
them; whatever the block started is ended by the fixture, even when the test fails, and what it
wrote into the repository (git-ignored: vlm-caption-demo/, the two logs) is removed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from vlm_caption.flows.server import ServerError, check_port_free
from tests.result_files import records as result_records

pytestmark = pytest.mark.timeout(2400)

REPO = Path(__file__).resolve().parents[1]
PORT = 4200  # the block's: nothing is substituted
API = f"http://127.0.0.1:{PORT}/api"
COMMAND_S = 1200  # the first `uv tool run` downloads Prefect; the demo and the run start vLLM on CPU
MARK = re.compile(r"rc(\d+)=(\d+)\r?\n")
# Before each prompt: the last command's exit status, numbered (the shell's first prompt is rc1).
PROMPT_COMMAND = '__rc=$?; __n=$((__n+1)); printf "rc%d=%d\\n" "$__n" "$__rc"'
QUESTION = re.compile(r"\[y/n\]")


def operate_block() -> list[str]:
    """The README's "Operate it" block as typed: each command its line, a continued line with
    the next (sent together); joined, they are the block byte for byte."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Operate it"):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    block = block[:block.index("```")]
    commands, pending = [], ""
    for line in block.splitlines(keepends=True):
        pending += line
        if not line.rstrip("\n").endswith("\\"):
            commands.append(pending)
            pending = ""
    assert "".join(commands) == block and "\t" not in block  # (a tab would ask bash to complete)
    return commands


def started_by(home: Path, shell: int) -> list[psutil.Process]:
    """Every process with this PREFECT_HOME but the shell: the server, the worker and its flow
    runs, whatever their parent now (the server runs in a session of its own)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != shell and proc.environ().get("PREFECT_HOME") == str(home):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def end_all(procs: list[psutil.Process]) -> None:
    every = {p.pid: p for p in procs}
    for proc in procs:
        try:
            every.update({child.pid: child for child in proc.children(recursive=True)})
        except psutil.NoSuchProcess:
            continue
    for proc in every.values():
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(list(every.values()), timeout=30)


class Operator:
    """An interactive bash on a pty; `type` sends one command as typed and returns its exit status."""

    def __init__(self, home: Path, transcript: Path):
        import pexpect

        venv_bin = str(REPO / ".venv" / "bin")
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("PREFECT_", "VLM_CAPTION_", "AWS_", "VIRTUAL_ENV"))}
        env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep) if d != venv_bin)
        if "PREFECT_SERVER_ANALYTICS_ENABLED" in os.environ:  # (CI's: no calls out from the server)
            env["PREFECT_SERVER_ANALYTICS_ENABLED"] = os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"]
        env.update({"PREFECT_HOME": str(home), "TERM": "xterm", "PS1": "$ ", "PROMPT_COMMAND": PROMPT_COMMAND})
        self.home, self.transcript = home, transcript
        self.shell = pexpect.spawn("bash", ["--norc", "--noprofile", "-i"], cwd=str(REPO), env=env,
                                   encoding="utf-8", timeout=COMMAND_S, dimensions=(50, 200))
        self.shell.logfile_read = open(transcript, "w")
        self.count = 0
        self.wait()

    def wait(self, questions: bool = False) -> int:
        self.count += 1
        while True:
            found = self.shell.expect([MARK, QUESTION] if questions else [MARK])
            assert found == 0, f"it asked a question:\n{self.tail()}"
            number, code = map(int, self.shell.match.groups())
            if number == self.count:
                return code

    def type(self, command: str) -> int:
        self.shell.send(command)
        return self.wait(questions=True)

    def tail(self, chars: int = 4000) -> str:
        self.shell.logfile_read.flush()
        return self.transcript.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        self.shell.close(force=True)
        self.shell.logfile_read.close()


@pytest.fixture
def operator(tmp_path):
    """The shell, and afterwards nothing left: the block's processes ended, what it wrote into the
    repository removed (what was there before stays)."""
    try:
        check_port_free("127.0.0.1", PORT)
    except ServerError as exc:
        pytest.skip(f"the README's block starts its server on port {PORT}, which is taken here: {exc}")
    if shutil.which("uv") is None:
        pytest.skip("the README's block runs `uv run ...`: uv is not on PATH")
    demo = REPO / "vlm-caption-demo"
    before = set(os.listdir(REPO))
    before_demo = set(os.listdir(demo)) if demo.is_dir() else None
    home = tmp_path / "prefect-home"
    shell = None
    try:
        shell = Operator(home, tmp_path / "terminal.txt")
        yield shell
    finally:
        if shell is not None:
            shell.close()
            end_all(started_by(home, shell.shell.pid))
        for name in set(os.listdir(REPO)) - before:  # vlm-caption-demo/ (if new), the logs
            path = REPO / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        if before_demo is not None and demo.is_dir():
            for name in set(os.listdir(demo)) - before_demo:  # captions-dev/, captions-prod/
                shutil.rmtree(demo / name, ignore_errors=True)


def test_the_readme_operate_block_as_pasted_by_a_newcomer(operator):
    commands = operate_block()
    assert commands[0].startswith("uv run vlm-caption server --background")
    assert commands[-1].startswith("uv run prefect deployment run vlm-caption/dev --watch")
    seen = 0
    for command in commands:
        code = operator.type(command)
        assert code == 0, f"exit {code}: {command!r}\n{operator.tail()}"
        screen = operator.transcript.read_text(errors="replace")
        if command.startswith("uv run vlm-caption server"):  # its lines, not the server's output
            said = screen[seen:]
            assert said.count("\n") <= 12 and f"up at http://127.0.0.1:{PORT}" in said, said
        seen = len(screen)

    screen = operator.transcript.read_text(errors="replace")
    run_id = re.findall(r"UUID:\s*([0-9a-f-]{36})", screen)[-1]  # the last command's run
    run = httpx.get(f"{API}/flow_runs/{run_id}", timeout=30).json()
    assert run["state_type"] == "COMPLETED", run["state"]
    assert run["name"] == f"llava · {REPO}/vlm-caption-demo/images/"
    dev = httpx.get(f"{API}/deployments/name/vlm-caption/dev", timeout=30).json()
    assert dev["parameters"]["job"]["model"] == f"{REPO}/vlm-caption-demo/tiny-llava"
    assert result_records(REPO / "vlm-caption-demo" / "captions-dev")
    # The server's and the worker's output went to their logs, not to the operator's terminal.
    worker_log = (REPO / "worker-0.log").read_text(errors="replace")
    assert "started!" in worker_log and "started!" not in screen
    server_log = (REPO / "vlm-caption-server.log").read_text(errors="replace")
    assert "  UI:  http://127.0.0.1:4200" in server_log and "  UI:  http" not in screen

    # The README's way to stop them: nothing of theirs is left, the port is free again. (A plain
    # `kill %1` relied on the shell's SIGTERM and uv's forwarded one reaching the worker apart: the
    # second kills it. Under load they arrived as one, and the worker polled on for minutes.)
    stop_worker, stop_server = "kill -KILL %1", "uv run vlm-caption server --stop"
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"`{stop_worker}` stops the worker" in readme and f"then `{stop_server}` the server" in readme
    assert operator.type(stop_worker + "\n") == 0
    assert operator.type(stop_server + "\n") == 0, operator.tail()
    deadline = time.time() + 300  # processes ending slowly on a loaded machine are not left behind
    while started_by(operator.home, operator.shell.pid) and time.time() < deadline:
        time.sleep(1)
    left = started_by(operator.home, operator.shell.pid)
    assert not left, [proc.info for proc in left]
    check_port_free("127.0.0.1", PORT)


def test_stop_finds_only_the_server_background_started(tmp_path, monkeypatch):
    """A pid file left by a server that ended, or naming a process that is not one (its pid taken
    again), is no server: `--stop` says so in one line and nothing is signalled."""
    import argparse

    from vlm_caption.flows.server import background_pid, pid_file, server_command

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    assert pid_file(4311) == tmp_path / "vlm-caption-server-4311.pid"
    pid_file(4311).write_text(f"{os.getpid()}\n")  # alive, but pytest
    assert background_pid(4311) is None
    stop = argparse.Namespace(host="127.0.0.1", port=4311, log="x.log", background=False, stop=True)
    with pytest.raises(ServerError, match="no server started by `vlm-caption server --background` runs on port 4311"):
        server_command(stop)
    assert not pid_file(4311).exists()
    with pytest.raises(ServerError, match="give one of them"):
        server_command(argparse.Namespace(**{**vars(stop), "background": True}))
