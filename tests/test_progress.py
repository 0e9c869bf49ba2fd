"""The terminal progress of `vlm-caption run`: a live bar on a terminal, plain lines elsewhere."""

from tasks.observability import TerminalProgress


def test_progress_is_plain_lines_when_not_a_terminal(capsys):
    progress = TerminalProgress(10, "Captioning s3://b/ with llava")
    assert progress.bar is None  # pytest captures stderr: not a terminal
    progress.advance(4, 1)
    progress.advance(6, 0)
    progress.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("vlm-caption: 4/10 items · ") and lines[0].endswith("· 1 errors")
    assert lines[1].startswith("vlm-caption: 10/10 items · ") and "ETA 0:00" in lines[1]
    assert "items/s" in lines[1]


def test_progress_is_a_live_bar_on_a_terminal(monkeypatch):
    from rich.console import Console

    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    progress = TerminalProgress(5, "Captioning")
    assert progress.bar is not None
    progress.advance(5, 2)
    task = progress.bar.tasks[0]
    assert (task.completed, task.total, task.fields["errors"]) == (5, 5, 2)
    progress.close()
