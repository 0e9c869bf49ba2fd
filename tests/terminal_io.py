"""A command run as a person runs it at a terminal (a pseudo-terminal), and what a quiet run's
terminal must and must not show (tasks/terminal.py)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import psutil

# Lines that belong in the log file, never on the default terminal: Prefect's log format, vLLM's
# loggers and the CPU host's warnings (Triton, NUMA binding, tcmalloc), Prefect's first-run
# telemetry notice, tqdm bars (transformers' "Writing model shards" as the demo builds its checkpoint).
NOISE = re.compile(r"\| (INFO|WARNING) +\||vllm\.|EngineCore|Triton|NUMA|tcmalloc|\"event\":|Error logging to API"
                   r"|Prefect collects anonymous usage data|Writing model shards|\d+%\|")


CTRL_C = b"\x03"  # what the Ctrl-C key types

# A shell's part in running a command at its terminal: the command in a process group of its own, the
# terminal's foreground group while it runs (a Ctrl-C typed reaches that group, not the shell), and the
# shell's again once it ended, so that what it left running gets no SIGHUP as the shell ends (it would
# as the command's own session ended). The exit code as a shell gives it: 128 + the signal that ended it.
SHELL = """
import os, signal, subprocess, sys
command = subprocess.Popen(sys.argv[1:], preexec_fn=os.setpgrp)
signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a shell takes the terminal back from the background
os.tcsetpgrp(0, command.pid)
code = command.wait()
os.tcsetpgrp(0, os.getpgrp())
sys.exit(code if code >= 0 else 128 - code)
"""


class Terminal:
    """`args` run by a shell (SHELL) on a 120x40 pseudo-terminal, its session's controlling terminal,
    as a person runs a command: a Ctrl-C typed there (`type(CTRL_C)`) is SIGINT to the command's
    process group. `screen` is everything the terminal received."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.leader, follower = pty.openpty()
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.process = subprocess.Popen([sys.executable, "-c", SHELL, *args], stdin=follower, stdout=follower,
                                        stderr=follower, env={**env, "TERM": "xterm"}, start_new_session=True,
                                        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(follower)
        self.received, self.args = bytearray(), args

    @property
    def screen(self) -> str:
        return self.received.decode(errors="replace")

    def read(self, seconds: float) -> bool:
        """What comes within `seconds` (at most one read's worth); False once nothing more can come."""
        ready, _, _ = select.select([self.leader], [], [], seconds)
        if ready:
            try:
                chunk = os.read(self.leader, 65536)
            except OSError:  # EIO: every holder of the terminal has closed it
                return False
            self.received += chunk
            return bool(chunk)
        return self.process.poll() is None

    def wait_for(self, seen: Callable[[], bool], timeout: float, what: str) -> None:
        """Read until `seen()` holds; TimeoutError (with the screen's end) if the command ended first or
        `timeout` passed."""
        deadline = time.monotonic() + timeout
        while not seen():
            if time.monotonic() > deadline or not self.read(0.2):
                self.kill()
                raise TimeoutError(f"{self.args}: no {what} within {timeout} s:\n{self.screen[-3000:]}")

    def type(self, data: bytes) -> None:
        os.write(self.leader, data)

    def wait(self, timeout: float) -> int:
        """Read to the end; the exit code. TimeoutError (the command killed) after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.read(1.0):
                return self.process.wait(timeout=60)
        self.kill()
        raise TimeoutError(f"{self.args} still running after {timeout} s:\n{self.screen[-3000:]}")

    def processes(self) -> list[psutil.Process]:
        """The command's processes now: it and every process it started, theirs too."""
        with contextlib.suppress(psutil.Error):  # the shell has ended
            return psutil.Process(self.process.pid).children(recursive=True)
        return []

    def kill(self) -> None:
        """The command's process group, and the shell."""
        with contextlib.suppress(psutil.Error, ProcessLookupError):  # the shell or the command has ended
            for command in psutil.Process(self.process.pid).children():
                os.killpg(command.pid, signal.SIGKILL)
        self.process.kill()
        self.process.wait()

    def close(self) -> None:
        if self.process.poll() is None:
            self.kill()
        os.close(self.leader)


def run_in_a_terminal(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """(exit code, everything the terminal received) for `args` on a 120x40 pseudo-terminal."""
    terminal = Terminal(args, env)
    try:
        return terminal.wait(timeout), terminal.screen
    finally:
        terminal.close()


def assert_quiet_terminal(screen: str, output: Path, items: int) -> Path:
    """The summary and the progress are on the terminal, the noise is not; the run's log file
    (named on the terminal, under the output's logs/) holds it. Returns the log file."""
    assert f"{items}/{items}" in screen, screen[-3000:]  # the progress, bar or lines
    assert "vlm-caption: run finished" in screen and f"{items} captioned: {items} ok" in screen, screen[-3000:]
    noise = [line for line in screen.splitlines() if NOISE.search(line)]
    assert not noise, noise[:10]
    finished = [shown for shown in re.split(r"[\r\n]", screen) if f"{items}/{items}" in shown]
    assert not [shown for shown in finished if "- items/s" in shown], finished  # the last rate is filled in
    (log,) = list((output / "logs").glob("run-*.log"))
    assert f"log      {log}" in screen
    kept = log.read_text(errors="replace")
    assert NOISE.search(kept) and "Beginning flow run" in kept, kept[-3000:]
    return log
