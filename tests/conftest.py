from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("VLM_CAPTION_LOG_FORMAT", "json")
# vLLM's CPU backend pins each engine's compute threads to core 0 (its "auto" binding keeps core 1
# for the engine's scheduler), so two engines at once -- the two xdist workers', raw's two
# processes, a fan-out's partitions -- share core 0 while core 1 waits. Unbound, the OS spreads
# them: the bench smoke alone went from 241 s to 222 s, its "raw, 2 processes" from 55.5 to 42.9 s.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# The product's engines on CPU run their model in the engine's process, not in a worker process
# of its own (tasks/engine/arguments.py sets this); set here too for the tests' own `vllm.LLM`s,
# whose engine then runs in the test's process instead of two spawned ones (each importing vLLM
# and torch again). tests/test_engine_faults.py and the kill tests ask for vLLM's own default (1).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# A Prefect home of this test process's own: the two xdist workers (-n 2, pyproject.toml) would
# otherwise share ~/.prefect's SQLite database and the job slots kept beside it.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix=f"vlm-caption-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")

# Where each pytest process (xdist's workers too: they inherit it) reports the processes it left
# behind; the process that started the session reads them at its end (pytest_sessionfinish).
os.environ.setdefault("PYTEST_LEFT_BEHIND_DIR", tempfile.mkdtemp(prefix="vlm-caption-tests-left-"))
SESSION_PREFECT_HOME = os.environ["PREFECT_HOME"]

from tests.checkpoints import build_checkpoint  # noqa: E402

pytest_plugins = ["tests.postgres"]  # the session's PostgreSQL and Prefect server

# The suite runs on two xdist workers (pyproject.toml: -n 2): most tests wait (on Prefect's
# server, a lease, an outage, a subprocess) about half the time, so on a 2-core machine two at
# once nearly halve the wall time. Three were slower (fresh .ci/run, 2026-11-26: 1342 s against
# 1229 s with two): what is left is CPU. A unit of work is a module, so its module fixtures and the
# engines its flows start in-process are made once; the Prefect stack's two modules are one unit,
# so there is one server with its workers. The longest units go first, so the two workers finish
# together; seconds from `--durations` of a fresh .ci/run on a 2-core machine (2026-11-27, 827 s).
# Modules not named here take under 30 s each and follow in file order.
STACK_MODULES = ("test_deployments", "test_api_outage")  # tests/postgres.py: prefect_stack
LONGEST_FIRST = {"prefect-stack": 420, "test_kills": 290, "test_bench": 220, "test_storage_faults": 170, "test_prefect_ui": 85,
                 "test_interrupt": 150, "test_media_flow": 80, "test_demo": 80, "test_engine_faults": 70, "test_concurrency": 45,
                 "test_recipe_checks": 45, "test_real_processors": 40, "test_render_pool": 30,
                 "test_separate_hosts": 450,  # (422-448 s with -n 0 on a busy 2-core machine, load 6-7)
                 "test_readme_operate": 400}  # (436 s with -n 0 on a busy 2-core machine, not a fresh .ci/run)


def schedule_unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return "prefect-stack" if module in STACK_MODULES else module


def pytest_xdist_make_scheduler(config, log):
    """xdist's module scheduling with the stack's modules as one unit. (Not `--dist loadgroup`:
    its groups ride on node ids that pytest 9.2 no longer lets a plugin rewrite.)"""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return schedule_unit(nodeid)

    return UnitScheduling(config, log)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which starts the workers
def pytest_cmdline_main(config) -> None:
    """`-s` (as the reliability page's commands use, to print a report line) runs in one process:
    an xdist worker's prints never reach the terminal."""
    if config.option.capture == "no":
        config.option.numprocesses = 0


# The fast tier (`uv run pytest -m fast`, CI's first step): every test that needs none of these
# fixtures (a checkpoint for an engine, a Prefect API, S3 on loopback, PostgreSQL) and is not in a
# module that starts processes of its own. `_no_process_in_the_fast_tier` holds them to it: a fast
# test that starts a process (an engine, a server, a subprocess) fails, naming this list.
HEAVY_FIXTURES = {"checkpoints_root", "prefect_api", "s3_endpoint", "postgres", "prefect_stack"}
HEAVY_MODULES = {"test_bench", "test_storage_faults", "test_prefect_ui", "test_media_flow", "test_demo",
                 "test_engine_faults", "test_concurrency", "test_recipe_checks", "test_real_processors",
                 "test_render_pool", "test_kills", "test_readme_operate", "test_resize", "test_gallery",
                 "test_prefect_api", "test_processor_device", "test_vllm_api", "test_interrupt", "test_scaling",
                 *STACK_MODULES}


# Tests of otherwise fast modules that start a process (a CLI in a subprocess, a decode pool, moto)
# or import vLLM (its video loader: about 25 s, a third of the tier).
HEAVY_TESTS = {
    "test_bad_inputs::test_each_video_decodes_or_fails_readably",
    "test_bad_inputs::test_the_whole_corpus_decodes_in_bounded_memory",
    "test_bad_inputs::test_the_video_corpus_decodes_in_bounded_memory",
    "test_listing_stream::test_memory_does_not_grow_with_the_listing",
    "test_model_check::test_cli_the_issue_offline_and_not_cached_is_one_line_in_seconds",
    "test_model_check::test_cli_too_little_disk_for_the_download",
    "test_operator_terminal::test_help_imports_neither_prefect_nor_vllm_nor_torch",
    "test_operator_terminal::test_bench_with_a_bad_size_is_one_line_and_exit_2",
    "test_operator_terminal::test_run_with_a_model_that_is_not_there_is_one_line_and_exit_2",
    "test_progress::test_a_quiet_run_sends_this_process_and_its_children_to_the_log_and_keeps_the_terminal",
    "test_progress::test_a_quiet_run_shuts_its_engine_down_into_the_log",
    "test_progress::test_prefects_first_run_notice_goes_to_the_quiet_runs_log",
    "test_recipes::test_chat_template_renders_offline_with_a_local_tokenizer",
    "test_recipes::test_recipes_show_imports_no_torch_or_vllm",
    "test_recipes::test_recipes_list_json_has_the_contract_columns",
    "test_structure::test_the_wheel_holds_one_top_level_package_that_imports_with_no_setting_changed",
}


def is_fast(item) -> bool:
    module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    name = item.nodeid.split("::", 1)[-1].split("[", 1)[0]
    on_s3 = "s3" in getattr(getattr(item, "callspec", None), "id", "").split("-")  # a case served by moto
    return (module not in HEAVY_MODULES and f"{module}::{name}" not in HEAVY_TESTS and not on_s3
            and not HEAVY_FIXTURES & set(getattr(item, "fixturenames", ())))


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "fast: starts no engine, server or process (the fast tier, tests/conftest.py)")


@pytest.fixture(autouse=True)
def _no_process_in_the_fast_tier(request, monkeypatch):
    if request.node.get_closest_marker("fast") is None:
        yield
        return
    import _posixsubprocess

    def refused(*args, **kwargs):
        raise RuntimeError(f"a fast-tier test started a process: add {request.node.module.__name__!r} to "
                           "HEAVY_MODULES in tests/conftest.py")

    monkeypatch.setattr(_posixsubprocess, "fork_exec", refused)  # multiprocessing's spawn
    monkeypatch.setattr(subprocess, "_fork_exec", refused)  # subprocess's own name for it
    for name in ("fork", "posix_spawn", "posix_spawnp"):
        monkeypatch.setattr(os, name, refused)
    yield


def pytest_collection_modifyitems(config, items) -> None:
    """Fast-tier tests marked; longest units first (xdist keeps this order: --no-loadscope-reorder);
    within a unit, file order, but the stack's outage test last: it restarts the server."""
    for item in items:
        if is_fast(item):
            item.add_marker(pytest.mark.fast)

    def key(item):
        unit = schedule_unit(item.nodeid)
        return -LONGEST_FIRST.get(unit, 0), unit == "prefect-stack" and "outage" in item.nodeid

    items.sort(key=key)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def release_engines_at_the_end():
    """The flows run in this process leave its engine up; it is shut down while the test
    session's output is still open (the exit hook would log into closed streams)."""
    yield
    if "vlm_caption.tasks.engine.vllm_engine" in sys.modules:
        sys.modules["vlm_caption.tasks.engine.vllm_engine"].release_engines()


@pytest.fixture(scope="session")
def checkpoints_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny_llava(checkpoints_root) -> Path:
    return build_checkpoint("llava", checkpoints_root)


@pytest.fixture(scope="session")
def prefect_api():
    """A real, temporary Prefect API (SQLite) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=600):  # a bound for a hung start, not a speed
        yield


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's standalone S3 server on loopback (its conditional PUTs atomic, as S3's are:
    bench/loopback_s3.py), reached over real HTTP by boto3."""
    from vlm_caption.bench.processes import started

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # stopped however the session ends (issue 68: no server left running after a failed test)
    with started([sys.executable, "-m", "vlm_caption.bench.loopback_s3", "-H", "127.0.0.1", "-p", str(port)],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as moto:
        # Waited for until it answers or ends, not for a fixed 30 s: on a loaded machine its imports
        # alone took longer, and this session-wide fixture's error then failed every S3 test after it.
        deadline = time.time() + 600
        while time.time() < deadline and moto.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise RuntimeError(f"moto server did not start (exit code {moto.poll()})")
        env = {
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "VLM_CAPTION_S3_ENDPOINT_URL": url,
        }
        from vlm_caption.bench.processes import settings_environment

        with settings_environment(env):
            yield url


@pytest.fixture
def s3_client(s3_endpoint):
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint)


# ---- no process left behind (issue 68) ------------------------------------------------------
# multiprocessing's helpers (its resource tracker, a pool's forkserver and workers) end with the
# interpreter that made them, after this hook: they are not left behind.
ENDS_WITH_US = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver", b"multiprocessing.spawn")


def processes_left_behind(basetemp: Path) -> list[str]:
    """Processes this test process started that still run once its fixtures are torn down: its
    children, and any process (detached, or orphaned when its parent ended) whose environment
    holds this process's Prefect home or a folder of its `basetemp` (a worker given a Prefect home
    of a test's own, and the engine it started)."""
    import psutil

    me, home = os.getpid(), f"PREFECT_HOME={SESSION_PREFECT_HOME}".encode()
    folder = f"{basetemp}/".encode()
    pids = {child.pid for child in psutil.Process(me).children(recursive=True)}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            environ = (proc / "environ").read_bytes()
            if int(proc.name) != me and (home in environ.split(b"\0") or folder in environ):
                pids.add(int(proc.name))
        except (OSError, ValueError):  # gone, or not ours to read
            continue
    found = []
    for pid in sorted(pids):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # ended already; its parent has not read its exit status yet
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            if any(helper in command for helper in ENDS_WITH_US) or b"execnet" in command:
                continue  # multiprocessing's helpers; xdist's workers (the session's controller)
            words = command.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid} {words[:200]}")
            os.kill(pid, 9)  # so the next session does not inherit it either
        except OSError:
            continue
    return found


BASETEMP: list[Path] = []  # this process's pytest temporary folder, once a test has run


@pytest.fixture(scope="session", autouse=True)
def _basetemp(tmp_path_factory):
    BASETEMP.append(tmp_path_factory.getbasetemp())


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    """Every process a test started is ended by its fixtures, even when it fails: one still
    running at the end fails the session, named (and is ended here)."""
    folder = Path(os.environ["PYTEST_LEFT_BEHIND_DIR"])
    left = processes_left_behind(BASETEMP[0]) if BASETEMP else []
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None:  # the controller reports them
        if left:
            (folder / f"{worker}.txt").write_text("\n".join(left))
        return
    for report in sorted(folder.glob("*.txt")):
        left += [f"{report.stem}: {line}" for line in report.read_text().splitlines()]
    if left:
        sys.stderr.write("\nprocesses left behind by the tests (ended now):\n" + "\n".join(left) + "\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
