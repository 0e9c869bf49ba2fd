"""Ctrl-C during `vlm-caption run` and `demo`: the first stops the run within seconds, the second
at once; both exit 130, as a shell expects of a command a Ctrl-C ended.

A Ctrl-C at a terminal reaches every process of the run: this one, vLLM's engine processes (which
shut down on it) and Prefect's embedded server (which stops). Left to Python, the KeyboardInterrupt
raised wherever this process's main thread is unwinds through code that waits: an engine being built
holds the engine lock until its engine process is up (a minute on a busy CPU), Prefect's client
reports the crash to a server that is stopping, the pools' threads are joined at exit; then the
traceback of wherever it was lands on the terminal.

So the first Ctrl-C prints one line and raises KeyboardInterrupt in the main thread, whose unwinding
lets the parts being written end (every part written is kept; a rerun resumes after them), and starts
a watchdog that gives it GRACE_S. Whichever comes first ends the run the same way: one line saying
what was kept, this process's children (the engine's processes, Prefect's server, the decode pool)
asked to end and killed after LINGER_S, and `os._exit`, which runs no exit hook that would wait
again. What the shutdown prints meanwhile stays in a quiet run's log (tasks/terminal.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator

import psutil  # imported here, not in the handler: a Ctrl-C may come in the middle of an import

from vlm_caption.tasks.terminal import stop_for_interrupt

GRACE_S = 3.0  # the main thread's time to unwind after the first Ctrl-C
LINGER_S = 0.5  # the children's time to end when asked (SIGTERM) before they are killed
EXIT_CODE = 130  # 128 + SIGINT

_asked = False  # the first Ctrl-C came
_tty = -1  # descriptor 2 as the command began: the terminal (a quiet run's 2 becomes its log)
_ending = threading.Lock()  # held by whichever ends the run: the main thread or the watchdog
_kept = 0  # items whose parts this command has written: what a stopped run says it kept
_landing = threading.Condition()  # guards _kept, _writing and _closed
_writing = 0  # parts being written now
_closed = False  # the run is ending: no part lands after what it said it kept


@contextlib.contextmanager
def stoppable(active: bool = True) -> Iterator[None]:
    """Ctrl-C as above while the command runs, the previous handler back after it (tests call the
    CLI in-process). Not `active`, or off the main thread (only it may set a handler): nothing changes."""
    global _tty, _kept, _writing, _closed
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    _tty, _kept, _writing, _closed = os.dup(2), 0, 0, False
    previous = signal.signal(signal.SIGINT, _on_ctrl_c)
    try:
        yield
    except BaseException:
        if not _asked:
            raise
        # Where the main thread was, and what it met on its way out: in a quiet run's log, where its
        # stderr goes; not on the terminal (with -v, stderr is it).
        if not os.path.samestat(os.fstat(2), os.fstat(_tty)):
            os.write(2, traceback.format_exc().encode(errors="replace"))
    finally:
        if _asked:
            _end()  # however the command came out of the Ctrl-C (it may even have ended as usual): stopped
        signal.signal(signal.SIGINT, previous)
        os.close(_tty)


def _on_ctrl_c(signum, frame) -> None:
    global _asked
    if _asked:
        _end(at_once=True)
    _asked = True
    stop_for_interrupt()  # the progress bar stops where it is; the shutdown's lines go to the run's log
    _say("vlm-caption: interrupted: stopping ... (Ctrl-C again to end at once)")
    watchdog = threading.Timer(GRACE_S, _end)
    watchdog.name, watchdog.daemon = "vlm-caption-interrupt", True
    watchdog.start()
    raise KeyboardInterrupt


class RunEnding(RuntimeError):
    """A part about to be written after a Ctrl-C's end said what was kept: not written."""


@contextlib.contextmanager
def part_landing(items: int) -> Iterator[None]:
    """Around a part's write of `items` items, on the writer's thread: counted in what a stopped run
    says it kept once it is on the output. The end waits for the parts being written before it says
    so, and a part not begun by then is not written (RunEnding): the line matches what the output
    holds, whichever thread's write ends in the gap between a part landing and the progress counting it."""
    global _writing, _kept
    with _landing:
        if _closed:
            raise RunEnding("the run is ending (Ctrl-C)")
        _writing += 1
    landed = False
    try:
        yield
        landed = True
    finally:
        with _landing:
            _writing -= 1
            _kept += items if landed else 0
            _landing.notify_all()


def _kept_at_end(wait_s: float) -> str:
    """What the output holds: no part begins after this, and the parts being written are waited
    for (`wait_s`, at most); one still being written then is named."""
    global _closed
    with _landing:
        _closed = True
        _landing.wait_for(lambda: _writing == 0, timeout=wait_s)
        late = f" ({_writing} part{'s' * (_writing > 1)} still being written)" if _writing else ""
        return f"{_kept} captioned kept{late}"


def _end(at_once: bool = False) -> None:
    """The end of a stopped run, from the main thread, the watchdog or a second Ctrl-C (which waits
    neither for the other two nor for the children). Never returns."""
    if _ending.acquire(blocking=not at_once):  # not acquired: the other is ending it, and has said so
        _say(f"vlm-caption: stopped; {_kept_at_end(0 if at_once else LINGER_S * 4)}, run again to resume")
    _end_children(0 if at_once else LINGER_S)
    os._exit(EXIT_CODE)


def exit_now_if_building(code: int) -> int:
    """A run that failed while its engine was still being built: nothing will use that engine,
    and Python's exit would wait for its build (minutes on a busy CPU: the build holds the engine
    lock that the exit hook takes). So its children are ended and the process exits now with
    `code`; with no build going on, `code` is returned."""
    engine = sys.modules.get("vlm_caption.tasks.engine.vllm_engine")
    if engine is None or not engine.building():
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    _end_children(LINGER_S)
    os._exit(code)


def _end_children(linger_s: float) -> None:
    """This process's children and theirs: asked to end, killed once `linger_s` has passed. Looked
    for again: a thread of the run may have started one meanwhile (a shard's retry, a new engine)."""
    for _ in range(3):
        children = psutil.Process().children(recursive=True)
        if not children:
            return
        for child in children:
            with contextlib.suppress(psutil.Error):  # ended already
                child.terminate()
        for child in psutil.wait_procs(children, timeout=linger_s)[1]:
            with contextlib.suppress(psutil.Error):
                child.kill()
        linger_s = 0.1


def _say(line: str) -> None:
    """A line on the terminal, written at once (a handler may interrupt a buffered write). On a
    terminal it replaces the `^C` the terminal echoed."""
    os.write(_tty, (("\r\x1b[K" if os.isatty(_tty) else "") + line + "\n").encode())
