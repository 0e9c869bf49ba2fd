"""Prefect's first-run telemetry notice, placed where a person reads it once: held when Prefect
is first imported (it would open a quiet run's terminal), then put in a quiet run's log with one
line of ours on the terminal (tasks/terminal.py), shown at the start of `vlm-caption server`, or
printed before a command's one-line error; anything else gets it on stderr as the process ends.
Prefect still decides whether to show it (a terminal, this PREFECT_HOME's first time) and marks
it shown; DO_NOT_TRACK=1 is its opt-out of Prefect's usage data, as the notice says."""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.machinery
import io
import sys
from typing import IO

# What Prefect printed when it was first imported in a terminal (its first-run telemetry notice),
# held for the run's terminal to place: in a quiet run's log, with one line of ours on the terminal.
NOTICE_MODULE = "prefect._internal.analytics.notice"
_prefect_notice: list[str] = []


class _PrefectNoticeHolder(importlib.abc.MetaPathFinder):
    """Wraps Prefect's `maybe_show_telemetry_notice` as its module is first imported (by
    `import prefect`, in the same statement, so the wrap is in place before it is called)."""

    def find_spec(self, name, path, target=None):
        if name != NOTICE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            show = getattr(module, "maybe_show_telemetry_notice", None)
            if callable(show):
                module.maybe_show_telemetry_notice = lambda: _hold_notice(show)

        spec.loader.exec_module = exec_module
        return spec


def hold_prefect_notice() -> None:
    """Hold Prefect's first-run notice instead of letting it open the terminal (call before
    Prefect is imported; flows/__init__.py does). Prefect still decides whether to show it (a
    terminal, its first run) and marks it shown; `quiet_terminal` puts it in the run's log, and
    anything else gets it on stderr as the process ends."""
    if "prefect" not in sys.modules and not any(isinstance(f, _PrefectNoticeHolder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PrefectNoticeHolder())


def _hold_notice(show) -> None:
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        show()
    if said.getvalue().strip():
        _prefect_notice.append(said.getvalue())
        atexit.register(release_notice, None)


def release_notice(terminal: IO[str] | None) -> None:
    """The held notice: whole on stderr (the log, in a quiet run), and one line of ours on the
    quiet run's `terminal`."""
    if not _prefect_notice:
        return
    text = "".join(_prefect_notice)
    _prefect_notice.clear()
    print(text, file=sys.stderr, flush=True)
    if terminal is not None:
        print("vlm-caption: Prefect's first-run telemetry notice is in the log (to opt out of Prefect's "
              "usage data: DO_NOT_TRACK=1)", file=terminal)


def show_prefect_notice_now(file: IO[str], *, import_prefect: bool = False) -> None:
    """Prefect's first-run notice, where Prefect has one for this terminal, printed now: at the
    start of `vlm-caption server` (the first command of the operator's path, so the notice is
    not in the middle of `prefect deploy` later: Prefect shows it once per PREFECT_HOME), or
    before a command's one-line error (not after it, as the process ends)."""
    if import_prefect and "prefect" not in sys.modules:
        import prefect  # noqa: F401 - Prefect decides on its import whether to show it

    if _prefect_notice:
        text = "".join(_prefect_notice).strip()
        _prefect_notice.clear()
        print(text, file=file, flush=True)
