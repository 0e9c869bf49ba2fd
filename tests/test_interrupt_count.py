"""What a run stopped by Ctrl-C says it kept (tasks/interrupt.py) is what its output holds: the end
waits for the parts being written, and no part begins after it said so. (A part that landed between
the line and the process's exit once made the line say 0 while the output held 4.)"""

from __future__ import annotations

import threading

import pytest

from vlm_caption.tasks import interrupt


@pytest.fixture
def fresh(monkeypatch):
    for name, value in {"_kept": 0, "_writing": 0, "_closed": False}.items():
        monkeypatch.setattr(interrupt, name, value)  # the module's state as a command begins, put back after
    return interrupt


def _write_part(items: int, release: threading.Event) -> tuple[threading.Thread, threading.Event]:
    """A part of `items` items being written on a writer's thread until `release`."""
    writing = threading.Event()

    def write():
        with interrupt.part_landing(items):
            writing.set()
            release.wait(10)

    thread = threading.Thread(target=write)
    thread.start()
    assert writing.wait(10)
    return thread, writing


def test_the_end_waits_for_a_part_being_written_and_no_part_begins_after(fresh):
    with fresh.part_landing(2):
        pass
    release = threading.Event()
    thread, _ = _write_part(4, release)
    threading.Timer(0.3, release.set).start()  # the part lands while the end waits
    assert fresh._kept_at_end(wait_s=10) == "6 captioned kept"
    thread.join()
    with pytest.raises(fresh.RunEnding), fresh.part_landing(3):
        pytest.fail("a part began after the end said what was kept")
    assert fresh._kept == 6


def test_a_failed_write_is_not_counted_and_a_part_still_writing_is_named(fresh):
    with pytest.raises(OSError), fresh.part_landing(5):
        raise OSError("no room")
    release = threading.Event()
    thread, _ = _write_part(4, release)
    try:
        assert fresh._kept_at_end(wait_s=0.1) == "0 captioned kept (1 part still being written)"
    finally:
        release.set()
        thread.join()
