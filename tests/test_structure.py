"""The code's shape, read from its source (tests/call_graph.py, its rules in its docstring): how
far a job travels from `vlm_caption`, which way the imports point, how long a module is, and that
the recipe is resolved once, by the plan."""

from __future__ import annotations

import ast
import re
import textwrap

import pytest

from tests.call_graph import (PACKAGES, TOOLS, import_cycles, load_modules, long_modules, tool_imports,
                              upward_imports, walk_job)

MOST_STOPS = 40
CODE_IMPORT = re.compile(r"(?:^|[\n;])\s*(?:from|import) (?:flows|tasks|recipes|deployments|bench)\b", re.M)  # issue 52's target for the walk of a job

# Upward imports still there, each with why; one fixed comes off this list (the test says so).
KNOWN_UPWARD: set[str] = set()


@pytest.fixture(scope="module")
def modules():
    return load_modules()


def test_no_import_cycles_among_flows_tasks_and_recipes(modules):
    """Between modules and between sub-packages (tasks.sources, tasks.media, tasks.engine,
    tasks.results, ...), imports inside functions counted: each sub-package sits on the ones below."""
    assert import_cycles(modules) == []
    assert import_cycles(modules, unit=lambda name: ".".join(name.split(".")[:2])) == []


def test_imports_point_down_from_flows_to_tasks_to_recipes(modules):
    upward = {f"{edge.source} -> {edge.target}" for edge in upward_imports(modules)}
    assert upward - KNOWN_UPWARD == set()
    assert KNOWN_UPWARD - upward == set(), "fixed: take it off KNOWN_UPWARD"


def test_the_product_never_imports_the_bench(modules):
    """The bench (bench/) is a tool beside the product: it imports flows, tasks and recipes, and
    none of them imports it, not even inside a function; the CLI reaches `vlm-caption bench`
    through "module:function" strings, imported only when it is used (flows/cli.py)."""
    assert tool_imports(modules) == []


def test_no_product_module_is_over_300_lines():
    assert long_modules(300) == {}


def test_a_job_travels_through_at_most_40_functions(modules):
    walk = walk_job(modules)
    listing = "\n".join(f"{module}: {', '.join(n for m, n in walk.stops if m == module)}"
                        for module in walk.module_names)
    assert len(walk.stops) <= MOST_STOPS, (
        f"{len(walk.stops)} stops in {len(walk.module_names)} modules:\n{listing}")


def _calls(module, name: str) -> list[int]:
    return [node.lineno for node in ast.walk(module.tree) if isinstance(node, ast.Call)
            and name == (node.func.id if isinstance(node.func, ast.Name)
                         else node.func.attr if isinstance(node.func, ast.Attribute) else None)]


def test_the_recipe_is_looked_up_by_name_once_and_engine_arguments_built_once():
    """A job finds its recipe by name when it is made (flows/params.py); the plan builds the
    engine's arguments from it (flows/plan.py, `EngineSpec`) and hands both down. The CLI's
    `recipes` commands and the bench's raw-vLLM phase are entry points of their own."""
    modules = load_modules(packages=(*PACKAGES, *TOOLS))
    lookups = {name for name, module in modules.items() if _calls(module, "get_recipe")}
    assert lookups == {"flows.params", "flows.cli", "bench.phases", "bench.driver"}
    builders = {name for name, module in modules.items() if _calls(module, "engine_args_for")}
    assert builders == {"tasks.engine.arguments", "recipes.requests"}  # EngineSpec, and `recipes show`
    specs = {name for name, module in modules.items() if _calls(module, "build") and "EngineSpec" in
             {n.id for n in ast.walk(module.tree) if isinstance(n, ast.Name)}}
    assert specs == {"flows.plan", "bench.phases"}


# ---- the walker itself, on a product of three modules ----------------------------------------
def _product(tmp_path, files: dict[str, str]):
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(text))
    for package in ("flows", "tasks", "recipes"):
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").touch()
    return load_modules(tmp_path)


def test_the_walk_follows_the_job_and_what_holds_it_and_nothing_else(tmp_path):
    modules = _product(tmp_path, {
        "flows/caption.py": """
            from dataclasses import dataclass
            from vlm_caption.flows.params import CaptionJob
            from vlm_caption.tasks import steps
            from vlm_caption.tasks.steps import lookup, unrelated

            @dataclass
            class Plan:
                job: CaptionJob

            def vlm_caption(job: CaptionJob):
                plan = make_plan(job)
                unrelated(3)
                return run(plan)

            def make_plan(job: CaptionJob) -> Plan:
                lookup(job.recipe)
                return Plan(job)

            def run(plan: Plan):
                return steps.caption(plan.job)
        """,
        "flows/params.py": "class CaptionJob:\n    recipe: str = 'llava'\n",
        "tasks/steps.py": """
            def lookup(name):
                return helper()

            def helper():
                return 1

            def unrelated(n):
                return n

            def caption(job):
                return lookup(job.recipe)
        """,
    })
    walk = walk_job(modules)
    assert walk.stops == [("flows.caption", "make_plan"), ("flows.caption", "run"), ("flows.caption", "vlm_caption"),
                          ("tasks.steps", "caption"), ("tasks.steps", "lookup")]
    assert walk.module_names == ["flows.caption", "tasks.steps"]


def test_cycles_and_upward_imports_are_found(tmp_path):
    modules = _product(tmp_path, {
        "tasks/a.py": "from tasks import b\n",
        "tasks/b.py": "import tasks.a\n\ndef late():\n    from flows import run\n",
        "flows/run.py": "from tasks import a\n",
        "recipes/base.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tasks import a\n",
    })
    # b's import inside a function closes a cycle through flows.run: lazy imports count
    assert import_cycles(modules) == [["flows.run", "tasks.a", "tasks.b"]]
    assert import_cycles(modules, unit=lambda name: name.split(".")[0]) == [["flows", "tasks"]]
    assert [(e.source, e.target) for e in upward_imports(modules)] == [("tasks.b", "flows.run")]


def test_a_tool_imported_by_the_product_is_found_even_inside_a_function(tmp_path):
    modules = _product(tmp_path, {
        "flows/cli.py": "OPTIONS = 'bench.cli:add_bench_arguments'\n\n"
                        "def handler():\n    from bench import run_bench\n",
        "tasks/late.py": "def f():\n    import bench.harness as harness\n",
        "recipes/top.py": "import benchmark_tools\nfrom bench.config import BenchConfig\n",
    })
    assert tool_imports(modules) == ["flows.cli:4 -> bench", "recipes.top:2 -> bench.config",
                                     "tasks.late:2 -> bench.harness"]



def test_the_product_and_its_tests_import_it_by_its_one_namespace():
    """Installed, flows, tasks, recipes, deployments and the bench live under `vlm_caption`
    (vlm_caption/__init__.py): an import of `tasks.x` works in a checkout only, and imports the
    module a second time beside `vlm_caption.tasks.x` (its state twice)."""
    from tests.call_graph import ROOT

    bare = []
    for folder in (*PACKAGES, *TOOLS, "deployments", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                bare += [f"{path.relative_to(ROOT)}:{node.lineno} {name}" for name in names
                         if name.split(".")[0] in (*PACKAGES, *TOOLS, "deployments")]
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and path.name != "test_structure.py":
                    # code run in another process (python -c): its imports are the installed package's too
                    bare += [f"{path.relative_to(ROOT)}:{node.lineno} {found.group(0).strip()}"
                             for found in CODE_IMPORT.finditer(node.value)]
    assert not bare, bare


def test_the_wheel_holds_one_top_level_package_that_imports_with_no_setting_changed(tmp_path):
    """`uv build`, the wheel unpacked alone on the path: `vlm_caption` is all it installs, and its
    flow module imports from there with the environment as it was."""
    import os
    import subprocess
    import sys
    import zipfile

    from tests.call_graph import ROOT

    subprocess.run(["uv", "build", "--wheel", "--out-dir", str(tmp_path / "dist")], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    wheel = zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl")))
    assert {name.split("/")[0] for name in wheel.namelist()} == {"vlm_caption", "vlm_caption-0.1.0.dist-info"}
    wheel.extractall(tmp_path / "site")
    script = ("import os; before = dict(os.environ); import vlm_caption.flows.caption, vlm_caption.bench.cli; "
              "assert dict(os.environ) == before; print(vlm_caption.flows.caption.__file__)")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(tmp_path / "site" / "vlm_caption" / "flows" / "caption.py")
