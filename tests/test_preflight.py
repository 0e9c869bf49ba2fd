"""Bad parameters fail before any engine starts, with a message that says what to do, and leave
nothing behind: unknown recipe, modality or engine argument, a bad scheme, a missing bucket or
folder, a source that cannot be listed, an output that cannot be written, no credentials."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

import vlm_caption.flows.caption

import vlm_caption.flows.feed_schedule
import vlm_caption.flows.pipeline
from vlm_caption import flows
from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.params import CaptionJob
from vlm_caption.recipes import RecipeError
from vlm_caption.tasks.sources.storage import StorageError
from tests.images import image_bytes


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an engine was started for a job that should have been refused")

    monkeypatch.setattr(flows.feed_schedule, "start_engine", refuse)  # where the shard pipeline finds them
    monkeypatch.setattr(flows.pipeline, "ShardStream", refuse)


def run(**fields):
    """The flow on a job whose model is not the point (one problem at a time; see the CLI's table)."""
    return vlm_caption(CaptionJob(**{"skip_model_check": True, **fields}))


@pytest.mark.parametrize("fields, message", [
    ({"recipe": "lava"}, "unknown recipe 'lava'"),
    ({"recipe": "llava", "modality": "video"}, "does not support modality 'video'"),
    ({"source": "gs://bucket/x/"}, "unsupported scheme 'gs'"),
    ({"source": "s3:///x/"}, "missing bucket name"),
])
def test_bad_job_fields_are_refused_when_the_job_is_built(tmp_path, fields, message):
    with pytest.raises(ValidationError, match=message):
        CaptionJob(**{"source": str(tmp_path), "output": str(tmp_path / "out"), **fields})


def test_unknown_engine_argument_names_close_matches(prefect_api, tmp_path, no_engine):
    with pytest.raises(RecipeError, match="unknown vLLM engine argument 'max_model_length'.*max_model_len"):
        run(source=str(tmp_path), output=str(tmp_path / "out"), engine_overrides={"max_model_length": 4096})
    assert not (tmp_path / "out").exists()


# A flow run's process from its start, watched: every Python parse (`ast.parse`, or a compile of an
# AST: the audit hook's "compile" events) with its thread, vLLM's import and the engine's build.
RUN_WATCHED = """
import ast, json, sys, threading, time

parses, windows = [], []
PARSE = ast.parse.__code__

def hook(event, args):
    if event == "compile" and (isinstance(args[0], ast.AST) or sys._getframe(1).f_code is PARSE):
        parses.append((time.monotonic(), threading.current_thread().name))
    elif event == "import" and args[0] == "vllm":
        windows.append(("vllm's first import", threading.current_thread().name, time.monotonic(), None))

sys.addaudithook(hook)

def watched(name, function):
    def call(*args, **kwargs):
        started = time.monotonic()
        try:
            return function(*args, **kwargs)
        finally:
            windows.append((name, threading.current_thread().name, started, time.monotonic()))
    return call

from vlm_caption.tasks.engine import vllm_engine, vllm_import

importing = vllm_import.ensure_vllm_imported
vllm_import.ensure_vllm_imported = lambda: (watched("vLLM's import", importing) if "vllm" not in sys.modules
                                            else importing)()
vllm_engine.CaptionEngine.__init__ = watched("the engine's build", vllm_engine.CaptionEngine.__init__)
from vlm_caption.flows.caption import vlm_caption
from vlm_caption.flows.params import CaptionJob

source, output, model = sys.argv[1:]
vlm_caption(CaptionJob(source=source, output=output, model=model, shard_size=2, sampling={"max_tokens": 4}))
print(json.dumps({"flow_thread": threading.current_thread().name, "parses": parses, "windows": windows}))
"""


def test_no_thread_parses_beside_vllms_import_or_the_engines_build(prefect_api, tiny_llava, tmp_path):
    """Python 3.11's AST constructor keeps its recursion depth in state that threads share
    (CPython gh-106905): two threads parsing at once failed a CI run with "AST constructor
    recursion depth mismatch". vLLM's import parses over a hundred times, so in a flow run's
    process (started fresh, with its engine first) it is made by the flow's own thread, and no
    other thread parses while it runs (Prefect's heartbeat thread, say, at the run's start), nor
    while the engine builds on its thread."""
    import json

    from prefect.settings import PREFECT_API_URL

    (tmp_path / "img").mkdir()
    for i in range(3):
        (tmp_path / "img" / f"{i}.jpg").write_bytes(image_bytes(size=(64 + i, 48)))
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run([sys.executable, "-c", RUN_WATCHED, str(tmp_path / "img"), str(tmp_path / "out"),
                          str(tiny_llava)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [line for line in run.stdout.splitlines() if line.startswith('{"flow_thread"')]
    watched = json.loads(line)
    windows = {name: (thread, start, end) for name, thread, start, end in watched["windows"]}
    flow_thread = watched["flow_thread"]
    assert windows["vllm's first import"][0] == windows["vLLM's import"][0] == flow_thread
    for name in ("vLLM's import", "the engine's build"):
        thread, start, end = windows[name]
        own = [t for t, by in watched["parses"] if start <= t <= end and by == thread]
        beside = sorted({by for t, by in watched["parses"] if start <= t <= end and by != thread})
        assert not beside, f"{beside} parsed during {name} on {thread}"
        if name == "vLLM's import":
            assert len(own) > 50  # the watch sees its parses


def test_missing_folder_and_bucket_and_manifest(prefect_api, tmp_path, s3_client, no_engine):
    with pytest.raises(StorageError, match="no such folder"):
        run(source=str(tmp_path / "nope"), output=str(tmp_path / "out"))
    with pytest.raises(StorageError, match="bucket .*does not exist"):
        run(source="s3://no-such-bucket/images/", output=str(tmp_path / "out"))
    with pytest.raises(StorageError, match="manifest not found"):
        run(manifest=str(tmp_path / "jobs.jsonl"), output=str(tmp_path / "out"), recipe="idefics3",
            modality="multi-image")


def test_an_output_that_cannot_be_written(prefect_api, tmp_path, s3_client, no_engine):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(StorageError, match="writing a probe object"):
        run(source=str(tmp_path), output=str(tmp_path / "a-file" / "out"))
    s3_client.create_bucket(Bucket="in-only")
    with pytest.raises(StorageError, match="does not exist"):
        run(source="s3://in-only/", output="s3://no-such-output-bucket/captions/")


def test_a_good_output_keeps_no_probe(prefect_api, tmp_path):
    from vlm_caption.tasks.sources.preflight import check_output

    check_output(str(tmp_path / "out" / "captions"))
    assert not (tmp_path / "out").exists()  # the folders made for the probe are gone again
    (tmp_path / "existing").mkdir()
    check_output(str(tmp_path / "existing"))
    assert list((tmp_path / "existing").iterdir()) == []


def test_missing_credentials_say_how_to_give_them(prefect_api, tmp_path, s3_endpoint, monkeypatch, no_engine):
    from vlm_caption.tasks.settings import get_settings

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    get_settings.cache_clear()
    try:
        with pytest.raises(StorageError, match="no S3 credentials.*AWS_ACCESS_KEY_ID.*VLM_CAPTION_AWS_CREDENTIALS_BLOCK"):
            run(source="s3://any-bucket/images/", output=str(tmp_path / "out"))
    finally:
        get_settings.cache_clear()
    assert not (tmp_path / "out").exists()


# ---- what the user sees: `vlm-caption run` with a bad input ------------------------------------
EXE = Path(sys.executable).with_name("vlm-caption")
NO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SESSION_TOKEN": None,
                  "AWS_PROFILE": None, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                  "AWS_CONFIG_FILE": "/nonexistent"}


def _bad_inputs(tmp: Path, s3_client) -> dict[str, tuple[list[str], dict, list[str]]]:
    """case -> (arguments, environment changes, what each line of the message says)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = tmp / "images"
    images.mkdir()
    (images / "a.png").write_bytes(image_bytes("PNG"))
    (tmp / "bad-schema.json").write_text('{"type": 12}')
    pq.write_table(pa.table({"id": [1], "url": ["a.png"]}), tmp / "rows.parquet")
    s3_client.create_bucket(Bucket="preflight-in")
    out = str(tmp / "out")
    fine = ["--skip-model-check"]
    return {
        "path": ([str(tmp / "nope"), "--out", out, *fine], {}, ["no such folder"]),
        "bucket": (["s3://no-such-bucket/images/", "--out", out, *fine], {}, ["bucket 'no-such-bucket' does not exist"]),
        "credentials": (["s3://preflight-in/", "--out", out, *fine], NO_CREDENTIALS, ["no S3 credentials"]),
        "unwritable output": ([str(images), "--out", "/proc/caps", *fine], {}, ["/proc/caps: not a usable folder"]),
        "engine argument": ([str(images), "--out", out, "--engine-arg", "max_modle_len=4", *fine], {},
                            ["unknown vLLM engine argument 'max_modle_len'. Did you mean: max_model_len?"]),
        "recipe": ([str(images), "--out", out, "--recipe", "lava", *fine], {}, ["unknown recipe 'lava'"]),
        "model": ([str(images), "--out", out, "--model", str(tmp / "no-model")], {},
                  [f"model folder {tmp / 'no-model'} does not exist"]),
        "schema": ([str(images), "--out", out, "--json-schema", str(tmp / "bad-schema.json"), *fine], {},
                   ["not a valid JSON Schema"]),
        "column": ([str(tmp / "rows.parquet"), "--out", out, "--column", "photo", *fine], {}, ["photo", "url"]),
        "path and engine argument": ([str(tmp / "nope"), "--out", out, "--engine-arg", "max_modle_len=4", *fine],
                                     {}, ["unknown vLLM engine argument", "no such folder"]),
    }


CASES = ["path", "bucket", "credentials", "unwritable output", "engine argument", "recipe", "model", "schema",
         "column", "path and engine argument"]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_input_is_one_line_exit_2_no_traceback_in_seconds(case, tmp_path, s3_endpoint, s3_client):
    args, env_changes, expected = _bad_inputs(tmp_path, s3_client)[case]
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_API_URL")}
    env.update({"HF_HUB_OFFLINE": "1", "VLM_CAPTION_S3_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true", "PREFECT_HOME": str(tmp_path / "prefect-home")})
    for key, value in env_changes.items():
        env.pop(key, None) if value is None else env.__setitem__(key, value)
    started, cpu_before = time.monotonic(), _children_cpu_s()
    done = subprocess.run([str(EXE), "run", *args], capture_output=True, text=True, env=env, timeout=120)
    took, cpu = time.monotonic() - started, _children_cpu_s() - cpu_before
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stdout == ""
    # One line per problem, each in the order the checks run, each saying what is wrong.
    problems = len(expected) if case == "path and engine argument" else 1
    assert len(lines) == problems and all(line.startswith("vlm-caption: error: ") for line in lines), lines
    for needle in expected:
        assert needle in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()  # nothing written, no folder made
    assert not (tmp_path / "prefect-home").exists()  # refused before Prefect started
    # Seconds of work to the message: the command's CPU time (its wall time is that on an idle
    # machine; under the suite's parallel load the wall clock measures the neighbours too).
    assert cpu < 3.0, f"{case}: {cpu:.1f} s of CPU ({took:.1f} s wall) to the message"


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_a_modality_the_source_does_not_hold_is_said_with_every_other_problem(tmp_path):
    """A folder of images asked for videos (and a model that is not there): both problems, each one
    line saying what to do, before anything starts; the right modality passes the check."""
    from vlm_caption.flows.params import CaptionJob
    from vlm_caption.flows.plan import PreflightError, make_plan
    from tests.images import image_bytes

    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(3):
        (photos / f"{i}.jpg").write_bytes(image_bytes(size=(32, 24)))
    (photos / "notes.txt").write_text("not media")
    with pytest.raises(PreflightError) as raised:
        make_plan(CaptionJob(source=str(photos), output=str(tmp_path / "out"), recipe="qwen2_vl", modality="video",
                             model=str(tmp_path / "no-such-model")))
    lines = str(raised.value)
    assert "holds images (0.jpg, ...), not videos: use --modality image" in lines
    assert "no-such-model" in lines
    job = CaptionJob(source=str(photos), output=str(tmp_path / "out"), recipe="qwen2_vl", skip_model_check=True)
    assert make_plan(job).job.modality == "image"


# ---- a fan-out whose source or output is a local folder ----------------------------------------
class PoolReads:
    """Prefect's client as the pre-flight reads it (the partition deployment, then its work pool),
    answering with Prefect's own objects; the reads counted."""

    def __init__(self, pool_type: str):
        self.pool_type, self.reads = pool_type, []

    def __call__(self, sync_client: bool = False):
        assert sync_client
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False

    def read_deployment_by_name(self, name: str):
        import uuid

        from prefect.client.schemas.responses import DeploymentResponse

        self.reads.append(name)
        return DeploymentResponse(id=uuid.uuid4(), name=name.split("/")[1], flow_id=uuid.uuid4(), work_pool_name="gpus")

    def read_work_pool(self, name: str):
        from prefect.client.schemas.objects import WorkPool

        self.reads.append(name)
        return WorkPool(name=name, type=self.pool_type)


def _fan_out_job(tmp_path, **fields) -> CaptionJob:
    photos = tmp_path / "photos"
    photos.mkdir(exist_ok=True)
    (photos / "a.jpg").write_bytes(image_bytes(size=(32, 24)))
    return CaptionJob(**{"source": str(photos), "output": str(tmp_path / "out"), "fan_out": 4,
                         "skip_model_check": True, **fields})


@pytest.fixture
def api_url():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: "http://prefect.internal:4200/api"}):
        yield


def test_a_local_output_for_partitions_in_containers_is_one_line_before_anything_starts(tmp_path, monkeypatch,
                                                                                        capsys, api_url):
    """A fan-out's partitions claim shards and write results in its output: a folder on the
    parent's disk is not there for partitions that a Kubernetes (or Docker, ...) worker starts in
    containers of their own. The pre-flight reads the partition deployment's pool (two reads for
    each local folder, only with fan_out > 1) and refuses the job in one line, exit 2; beside the
    local source's line (the next test), one line each."""
    import prefect.client.orchestration

    from vlm_caption.flows.cli import report_user_error
    from vlm_caption.flows.plan import PreflightError, make_plan

    reads = PoolReads("kubernetes")
    monkeypatch.setattr(prefect.client.orchestration, "get_client", reads)
    with pytest.raises(PreflightError) as raised:
        make_plan(_fan_out_job(tmp_path))
    assert reads.reads == ["vlm-caption/partition", "gpus"] * 2  # the source's, then the output's
    assert report_user_error(raised.value) == 2
    source_line, line = capsys.readouterr().err.splitlines()
    assert source_line.startswith(f"vlm-caption: error: {tmp_path / 'photos'}: a local source folder cannot be read ")
    assert line == (f"vlm-caption: error: {tmp_path / 'out'}: a local output folder cannot be shared by a fan-out's "
                    "partitions, which 'vlm-caption/partition' runs in containers of their own (work pool 'gpus', "
                    "type kubernetes): write to s3://, or set fan_out=1")
    assert not (tmp_path / "out").exists()

    with pytest.raises(PreflightError) as both:  # with every other problem, one line each
        make_plan(_fan_out_job(tmp_path, source=str(tmp_path / "nope")))
    source, output = both.value.problems  # a source that is not there says so (not where it is)
    assert "no such folder" in source and output == line.removeprefix("vlm-caption: error: ")


def test_a_local_source_for_partitions_in_containers_is_one_line_and_kept_for_a_process_pool(tmp_path, monkeypatch,
                                                                                             capsys, api_url):
    """A fan-out's partitions read the media themselves: a source on the parent's disk (a folder,
    or a manifest, tar or Parquet file, by its path or a file:// URI) is not there for partitions
    in containers of their own. The pre-flight refuses it in one line, exit 2, as it does a local
    output; a process pool's partitions, or a run that does not fan out, read it."""
    import prefect.client.orchestration

    from vlm_caption.flows.cli import report_user_error
    from vlm_caption.flows.plan import make_plan
    from vlm_caption.tasks.sources.preflight import resolve_source

    import tarfile

    photos = _fan_out_job(tmp_path).source
    (tmp_path / "jobs.jsonl").write_text('{"id": "a", "media": ["photos/a.jpg"]}\n')
    with tarfile.open(tmp_path / "shard-000.tar", "w") as tar:
        tar.add(f"{photos}/a.jpg", arcname="a.jpg")
    containers = PoolReads("docker")
    monkeypatch.setattr(prefect.client.orchestration, "get_client", containers)
    for source in (photos, f"file://{photos}", str(tmp_path / "jobs.jsonl"), str(tmp_path / "shard-000.tar")):
        where = {"source": None, "manifest": source} if source.endswith(".jsonl") else {"source": source}
        with pytest.raises(StorageError) as raised:
            resolve_source(_fan_out_job(tmp_path, **where), "vlm-caption/partition")
        assert report_user_error(raised.value) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line == (f"vlm-caption: error: {source}: a local source folder cannot be read by a fan-out's "
                        "partitions, which 'vlm-caption/partition' runs in containers of their own (work pool "
                        "'gpus', type docker): read from s3://, or set fan_out=1")
    assert containers.reads == ["vlm-caption/partition", "gpus"] * 4
    assert make_plan(_fan_out_job(tmp_path, fan_out=1)).job.fan_out == 1  # nothing read: no partitions
    assert containers.reads == ["vlm-caption/partition", "gpus"] * 4

    process = PoolReads("process")
    monkeypatch.setattr(prefect.client.orchestration, "get_client", process)
    _, spec = resolve_source(_fan_out_job(tmp_path), "vlm-caption/partition")
    assert spec.uri == photos and process.reads == ["vlm-caption/partition", "gpus"]


def test_a_local_output_is_kept_for_a_process_pool_a_single_run_or_no_api(tmp_path, monkeypatch, api_url):
    """A process pool's workers run partitions on hosts that may share the folder (one host, or a
    network file system: docs/operations.md says they must); a run that does not fan out, or whose
    server is the embedded one (no worker reaches it), reads nothing."""
    import prefect.client.orchestration
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from vlm_caption.flows.plan import make_plan

    real = prefect.client.orchestration.get_client
    process = PoolReads("process")
    monkeypatch.setattr(prefect.client.orchestration, "get_client", process)
    assert make_plan(_fan_out_job(tmp_path)).job.fan_out == 4
    assert process.reads == ["vlm-caption/partition", "gpus"] * 2  # the local source's, then the output's

    containers = PoolReads("docker")
    monkeypatch.setattr(prefect.client.orchestration, "get_client", containers)
    make_plan(_fan_out_job(tmp_path, fan_out=1))
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        make_plan(_fan_out_job(tmp_path))
    assert containers.reads == []

    # An API nobody answers: the CLI says so right after the plan, the flow cannot start without one.
    monkeypatch.setattr(prefect.client.orchestration, "get_client", real)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert make_plan(_fan_out_job(tmp_path)).job.fan_out == 4
