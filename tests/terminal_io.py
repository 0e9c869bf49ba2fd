"""A command run as a person runs it at a terminal (a pseudo-terminal), and what a quiet run's
terminal must and must not show (tasks/terminal.py)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

# Lines that belong in the log file, never on the default terminal: Prefect's log format, vLLM's
# loggers and the CPU host's warnings (Triton, NUMA binding, tcmalloc), Prefect's first-run
# telemetry notice, tqdm bars (transformers' "Writing model shards" as the demo builds its checkpoint).
NOISE = re.compile(r"\| (INFO|WARNING) +\||vllm\.|EngineCore|Triton|NUMA|tcmalloc|\"event\":|Error logging to API"
                   r"|Prefect collects anonymous usage data|Writing model shards|\d+%\|")


def run_in_a_terminal(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """(exit code, everything the terminal received) for `args` on a 120x40 pseudo-terminal."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(args, stdin=follower, stdout=follower, stderr=follower, env={**env, "TERM": "xterm"},
                               start_new_session=True)
    os.close(follower)
    received, deadline = bytearray(), time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: every holder of the terminal has closed it
                    break
                if not chunk:
                    break
                received += chunk
            elif process.poll() is not None:
                break
        else:
            process.kill()
            raise TimeoutError(f"{args} still running after {timeout} s:\n{received.decode(errors='replace')[-3000:]}")
        return process.wait(timeout=60), received.decode(errors="replace")
    finally:
        os.close(leader)


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
