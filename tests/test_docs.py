"""The docs agree with the code: the generated pages are what their generators print now, every
`VLM_CAPTION_*` variable the code reads is on docs/configuration.md, every `vlm-caption ...`
command in a fenced code block of README.md and docs/*.md (and in a table cell of docs/*.md: the
benchmarks' commands) parses as the CLI parses it, and a job it describes is a valid job, and
every relative link leads to a file. No engine, no Prefect: seconds."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import pytest

from vlm_caption.flows.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The README's two commands are a contract: the demo, and the tests (what .ci/run runs).
TWO_COMMANDS = """```bash
# 1. Set up and run the demo (offline, CPU: tiny random-weight model, noise captions)
python3 -m pip install uv && uv sync --extra cpu && uv run vlm-caption demo

# 2. Set up and run the tests (what .ci/run calls)
python3 -m pip install uv && uv sync --extra cpu && uv run pytest -v
```"""
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
MENTION = re.compile(r"(?:^|[\s;&|(])vlm-caption(?:\s|$)")  # not vlm-caption-gpu, vlm-caption.run.*
VARIABLE = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?")
CODE_DIRS = ("flows", "tasks", "recipes", "deployments", "bench", "tests")


def fenced_lines(text: str) -> list[str]:
    """The lines inside ``` fences, continuations (a trailing backslash) joined."""
    lines, inside, pending = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return lines


def table_commands(text: str) -> list[str]:
    """Inline `vlm-caption ...` commands with options in the cells of Markdown tables (a bare
    `vlm-caption run` there names the command, it is not one to run)."""
    return [span for line in text.splitlines() if line.startswith("|")
            for span in re.findall(r"`(vlm-caption [^`]+)`", line) if " --" in span]


def cli_calls(line: str) -> list[list[str]]:
    """The arguments after `vlm-caption` of each command on a shell line that runs it (`uv run`
    and `NAME=value` before it allowed). Variables stand for a value; a command ends at a comment,
    a pipe, a redirection, `&&` or `;`."""
    if not MENTION.search(line):
        return []
    lexer = shlex.shlex(VARIABLE.sub("1", line.strip().removeprefix("$ ")), posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    calls, segment = [], []
    for token in [*lexer, ";"]:
        if not set(token) <= set("|&;<>()"):
            segment.append(token)
            continue
        while segment and ASSIGNMENT.match(segment[0]):
            segment.pop(0)
        if segment[:2] == ["uv", "run"]:
            segment = segment[2:]
        if segment[:1] == ["vlm-caption"]:
            calls.append(segment[1:])
        segment = []
        if token[0] in "<>":  # what follows a redirection is its target
            break
    return calls


def invocations() -> list[tuple[str, list[str]]]:
    """(page, arguments) for every `vlm-caption` call the docs show: in fenced code blocks, and
    in the table cells of docs/*.md."""
    found = []
    for page in PAGES:
        text, name = page.read_text(), page.relative_to(REPO).as_posix()
        lines = fenced_lines(text) + (table_commands(text) if page.parent.name == "docs" else [])
        found += [(name, args) for line in lines for args in cli_calls(line)]
    return found


def check_invocation(args: list[str]) -> None:
    """Parse as the CLI does, then what the parser leaves to the job: the recipe, and whether it
    takes the modality (`run` builds the whole job, as `vlm-caption run` would)."""
    from vlm_caption.flows.cli_job import job_fields
    from vlm_caption.recipes import get_recipe

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parsed = build_parser().parse_args(args)
    except SystemExit as exc:
        assert exc.code == 0, errors.getvalue().strip().splitlines()[-1]  # --help exits 0
        return
    if parsed.command == "run":
        from vlm_caption.flows.params import CaptionJob

        CaptionJob(source=parsed.source, manifest=parsed.manifest, output=parsed.out, **job_fields(parsed))
    elif parsed.command in ("demo", "bench"):
        get_recipe(parsed.recipe).prompting(parsed.modality or "image")
    elif parsed.command == "recipes" and parsed.recipes_command == "show":
        get_recipe(parsed.name).prompting(parsed.modality)


def test_the_readme_keeps_the_two_commands():
    assert TWO_COMMANDS in (REPO / "README.md").read_text()


def test_every_documented_command_parses():
    found = invocations()
    assert len(found) >= 30, f"only {len(found)} vlm-caption commands found in the docs"
    failures = []
    for page, args in found:
        try:
            check_invocation(args)
        except (AssertionError, ValueError, LookupError) as exc:  # pydantic's and recipes' errors are ValueErrors
            failures.append(f"{page}: vlm-caption {shlex.join(args)}\n    {str(exc).splitlines()[0]}")
    assert not failures, "documented commands the CLI refuses:\n" + "\n".join(failures)


def test_the_command_reader_sees_what_a_shell_runs():
    text = "```bash\nuv run vlm-caption run s3://b/ --recipe qwen2_vl \\\n    --modality video --out $OUT  # note\n```"
    [line] = fenced_lines(text)
    assert cli_calls(line) == [["run", "s3://b/", "--recipe", "qwen2_vl", "--modality", "video", "--out", "1"]]
    assert cli_calls("vlm-caption recipes list --markdown > docs/recipes.md") == [["recipes", "list", "--markdown"]]
    assert cli_calls("pip install uv && uv sync && uv run vlm-caption demo") == [["demo"]]
    assert cli_calls("CUDA_VISIBLE_DEVICES=0 uv run vlm-caption bench --gpus 1 &") == [["bench", "--gpus", "1"]]
    assert cli_calls("write-manifest → vlm-caption.run.completed") == []
    assert table_commands("| a | `vlm-caption bench --images 8` | `vlm-caption run` |\n`vlm-caption run --out x`") == [
        "vlm-caption bench --images 8"]
    with pytest.raises(AssertionError):
        check_invocation(["run", "./photos", "--out", "./captions", "--modality", "audio"])
    with pytest.raises(ValueError):
        check_invocation(["run", "./photos", "--out", "./captions", "--recipe", "llava", "--modality", "video"])


def test_configuration_page_is_generated_from_the_settings():
    from tests.configuration_page import REGENERATE, settings_markdown
    from vlm_caption.tasks.settings import Settings

    page = (REPO / "docs" / "configuration.md").read_text()
    missing = [name for name in Settings.model_fields if f"`VLM_CAPTION_{name.upper()}`" not in page]
    assert not missing, f"settings missing from docs/configuration.md: {missing}; run {REGENERATE}"
    undescribed = [name for name, field in Settings.model_fields.items() if not field.description]
    assert not undescribed, f"settings without a description= in tasks/settings.py: {undescribed}"
    assert page == settings_markdown(), f"docs/configuration.md is stale: run {REGENERATE}"


def test_every_variable_the_code_reads_is_documented():
    from tests.configuration_page import REGENERATE

    page = (REPO / "docs" / "configuration.md").read_text()
    used = set()
    for folder in CODE_DIRS:
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".yaml", ".json", "") and path.name != "test_docs.py":
                used |= set(re.findall(r"VLM_CAPTION_[A-Z][A-Z0-9_]*", path.read_text(errors="ignore")))
    missing = sorted(name for name in used if f"`{name}`" not in page)
    assert not missing, (f"variables read in the code but not on docs/configuration.md: {missing}; add them to "
                         f"Settings in tasks/settings.py or OTHER_VARIABLES in tests/configuration_page.py and run "
                         f"{REGENERATE}")


def test_recipes_page_is_generated_from_the_recipes():
    from vlm_caption.recipes import all_recipes
    from vlm_caption.recipes.table import REGENERATE, recipes_markdown

    page = (REPO / "docs" / "recipes.md").read_text()
    assert page == recipes_markdown(), f"docs/recipes.md is stale: run {REGENERATE}"
    assert all(f"| `{recipe.name}` |" in page for recipe in all_recipes())
    assert "| `qwen2_vl` | qwen | `Qwen/Qwen2-VL-7B-Instruct` | image, video, multi-image | - | yes | 1 |" in page


def test_relative_links_lead_to_files():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not os.path.exists(path):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, f"links to nothing: {broken}"
