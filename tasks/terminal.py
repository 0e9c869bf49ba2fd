"""What a person at a terminal sees of `vlm-caption run` and `demo`: a progress bar, then a summary
(docs/operations.md, "What the UI shows"). `quiet_terminal` sends descriptors 1 and 2 to the run's log,
so the engine's processes and the embedded Prefect server (children inherit them) write there too, as
does what the process prints as it exits; the bar and the summary keep the terminal (`user_stream`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import IO, Any, Iterator

from vlm_caption.tasks.prefect_api import release_notice

# The terminal's stderr while a quiet run holds descriptors 1 and 2; None otherwise.
_terminal: IO[str] | None = None
# The run's progress on the terminal (the latest), and whether a Ctrl-C stopped the run (tasks/interrupt.py).
_progress: TerminalProgress | None = None
_interrupted = False
_exit_log: list[Path] = []  # where what the process prints as it exits goes: the last quiet run's log

def user_stream() -> IO[str]:
    """Where the progress bar goes: the terminal, whatever a quiet run did to stderr."""
    return _terminal if _terminal is not None else sys.stderr


@contextlib.contextmanager
def quiet_terminal(log_path: Path) -> Iterator[Path]:
    """Descriptors 1 and 2 (this process and every child started meanwhile) to `log_path`."""
    global _terminal
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with open(log_path, "ab", buffering=0) as log:
        terminal = os.fdopen(os.dup(saved[2]), "w", buffering=1, encoding="utf-8", errors="replace")
        print(f"vlm-caption: the run's log (Prefect, vLLM): {log_path}", file=terminal)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        _terminal = terminal
        release_notice(terminal)
        try:
            yield log_path
        finally:
            _terminal = None
            # Stopped by a Ctrl-C, the run's end ends the engine and the server (tasks/interrupt.py), and
            # what they and the run's threads print as they end stays in the log: 1 and 2 are left on it.
            if not _interrupted:
                # The engine shut down now, into the log: at exit vLLM's process manager may say, on the
                # terminal, that it force-killed an engine process slow to end (on a busy machine).
                engine = sys.modules.get("vlm_caption.tasks.engine.vllm_engine")  # imported only if one started
                try:
                    if engine is not None:
                        engine.release_engines()
                except Exception as exc:  # noqa: BLE001 - the run is over: nothing here may fail it
                    print(f"vlm-caption: the engine not shut down now ({type(exc).__name__}: {exc}); it is as the "
                          "process ends", file=sys.stderr)  # the run's log
                sys.stdout.flush()
                sys.stderr.flush()
                for fd, copy in saved.items():
                    os.dup2(copy, fd)
                    os.close(copy)
                if not _exit_log:
                    atexit.register(_to_exit_log)
                _exit_log[:] = [log_path]
            terminal.close()


@contextlib.contextmanager
def run_terminal(output: str, *, verbose: bool, log_format: str | None) -> Iterator[Path | None]:
    """The terminal during a run: a progress bar, everything else in the run's log file (its path
    yielded); with -v or --log-format json, every line on the terminal as it comes (None)."""
    if verbose or log_format == "json":
        release_notice(None)  # every line on the terminal as it comes: Prefect's notice too
        yield None
        return
    from vlm_caption.tasks.settings import get_settings

    # VLM_CAPTION_LOG_DIR, else `logs/` in a folder output, else `./vlm-caption-logs/` (an S3 output
    # is written by many hosts; the log is this host's).
    folder = Path(get_settings().log_dir or (Path(output) / "logs" if "://" not in output else "vlm-caption-logs"))
    name = f"run-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}.log"
    with quiet_terminal(folder.resolve() / name) as log_path:
        yield log_path


def stop_for_interrupt() -> None:
    """A Ctrl-C (tasks/interrupt.py): the progress stops where it is, its bar left as it was and the
    cursor shown, and a quiet run keeps its log as descriptors 1 and 2 to the end."""
    global _interrupted
    _interrupted = True
    if _progress is not None:
        _progress.stop()


def say_phase(what: str) -> None:
    """A step of the run beginning (`tasks.observability.phase`), on a quiet run's terminal with the
    seconds since the command began (above the progress bar once it shows)."""
    if _terminal is None or _interrupted:
        return
    import psutil

    line = f"vlm-caption: {time.time() - psutil.Process().create_time():5.1f} s  {what}"
    if _progress is not None and _progress.bar is not None and not _progress.stopped:
        _progress.console.print(line, highlight=False, soft_wrap=True)
    else:
        print(line, file=_terminal, flush=True)


def _to_exit_log() -> None:
    """Descriptors 1 and 2 to the last quiet run's log as the process exits: what it prints then
    (Prefect stopping its embedded server, a line on stderr) goes there. Registered as a quiet run
    ends, after Prefect's exit hooks (its server started during the run), it runs before them."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        log = os.open(_exit_log[0], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError:  # its folder removed meanwhile (a caller's temporary one): the terminal, then
        return
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)


def _fit(text: str, width: int) -> str:
    """The bar's label within `width` (a long source path would push the counts off the line):
    its first word and the end of the rest, where a path says which folder it is."""
    if len(text) <= width:
        return text
    head, _, rest = text.partition(" ")
    if not rest or len(head) + 3 > width:
        return text[: max(width - 1, 1)] + "…"
    return f"{head} …{rest[len(rest) - (width - len(head) - 2):]}"


class TerminalProgress:
    """Items, items/s, ETA and errors in the terminal: a live rich bar on a terminal, one plain
    line per shard otherwise (CI logs, `| tee`, a worker's output)."""

    # Shards in the engine together finish together: a rate over less than this is noise.
    RATE_WINDOW_S = 2.0

    def __init__(self, total_items: int, description: str):
        from rich.console import Console

        global _progress
        _progress = self
        self.total, self.done, self.errors = total_items, 0, 0
        self.stopped = False  # by a Ctrl-C: nothing more is shown
        # The rate counts from the first result: before it come the listing and the engine's
        # start (the longest wait of a run), which would make the first ETAs several times too long.
        self.first: tuple[float, int] | None = None  # when, and how many items were done then
        self.started = time.monotonic()
        self.console = Console(file=user_stream())
        self.bar = None
        if self.console.is_terminal:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeRemainingColumn)

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                                TextColumn("{task.fields[rate]} items/s"), TimeRemainingColumn(),
                                TextColumn("{task.fields[errors]} errors"), console=self.console,
                                transient=False)
            self.task = self.bar.add_task(_fit(description, self.console.width // 3), total=total_items,
                                          rate="-", errors=0)
            self.bar.start()

    def grow(self, items: int) -> None:
        """More items listed (the listing is streamed)."""
        self.total += items
        if self.bar is not None:
            self.bar.update(self.task, total=self.total)

    def advance(self, items: int, errors: int) -> None:
        self.done += items
        self.errors += errors
        now = time.monotonic()
        if self.first is None and self.done:
            self.first = (now, self.done)
        rate = None
        if self.first is not None and now - self.first[0] >= self.RATE_WINDOW_S:  # items/s since the first result
            rate = (self.done - self.first[1]) / (now - self.first[0])
        elif self.done >= self.total:
            rate = self.whole_rate(now)  # all done within the window (a small run): never "-" at the end
        shown = "-" if rate is None else f"{rate:.2f}"
        if self.stopped:
            return
        if self.bar is not None:
            self.bar.update(self.task, advance=items, rate=shown, errors=self.errors)
            return
        left = self.total - self.done
        eta = "0:00" if left == 0 else "-" if not rate else f"{int(left / rate) // 60}:{int(left / rate) % 60:02d}"
        self.console.print(f"vlm-caption: {self.done}/{self.total} items · {shown} items/s · ETA {eta} · "
                           f"{self.errors} errors", highlight=False, soft_wrap=True)

    def whole_rate(self, now: float) -> float | None:
        """Items/s since the progress began (the engine's start included), for a run whose
        results all came within RATE_WINDOW_S of the first."""
        return self.done / (now - self.started) if self.done and now > self.started else None

    def close(self) -> None:
        if self.bar is not None and not self.stopped:
            if self.bar.tasks[0].fields["rate"] == "-" and (rate := self.whole_rate(time.monotonic())):
                self.bar.update(self.task, rate=f"{rate:.2f}")  # a run that stopped short of its total
            self.bar.stop()

    def stop(self) -> None:
        """Stopped where it is (a Ctrl-C): the bar's last state stays on the terminal."""
        self.stopped = True
        if self.bar is not None:
            self.bar.stop()


def print_run_end(summary: dict[str, Any], output: str, log_path: Path | None, log_format: str | None,
                  source: str | None = None, file: IO[str] | None = None) -> None:
    """The end of `run` and `demo`: one JSON object for a machine, or for a person what was captioned,
    how fast and where it all is, in plain aligned lines (no table folding): paths stay whole for copy
    and paste, and for grep."""
    file = file or sys.stdout
    if log_format == "json":
        print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=2), file=file)
        return
    by_kind = summary.get("failed_by_kind") or {}
    failed = f"{summary['failed']} failed" + (
        " (" + ", ".join(f"{kind} {count}" for kind, count in sorted(by_kind.items())) + ")" if by_kind else "")
    rows = [("source", source)] if source else []
    rows += [
        ("items", f"{summary['processed']} captioned: {summary['succeeded']} ok, {failed}; "
                  f"{summary['skipped_already_done']} already done"),
        ("speed", f"{summary['items_per_s']:.2f} items/s over {summary['wall_s']:.0f} s "
                  f"({summary['generate_items_per_s'] or 0:.2f} while generating, "
                  f"{summary['output_tokens_per_s']:.0f} output tokens/s)"),
        ("results", f"{output.rstrip('/')}/parquet/"),  # the view: every run's results, read as one dataset
    ]
    rows += [(name, str(summary[name])) for name in ("quality", "cost", "manifest", "gallery", "parquet")
             if summary.get(name)]
    if log_path is not None:
        rows.append(("log", str(log_path)))
    print("vlm-caption: run finished", file=file)
    for name, value in rows:
        print(f"  {name:<9}{value}", file=file)
