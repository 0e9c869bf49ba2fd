"""What surrounds the bench's phases: GPU utilization sampled through NVML while a phase runs,
the Prefect API the flow phases talk to (the embedded server, or one `prefect server start` of
the bench's own), the S3 endpoint the items are served from, and the workers a fanned-out
phase's partitions run on."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from vlm_caption.bench.processes import started

REPO = Path(__file__).resolve().parents[1]
LOOPBACK_S3 = "s3://bench"  # the bucket of the bench's own moto server
S3_BLOCK = "vlm-caption-s3"  # the credentials block deployments/prefect.yaml's runs read


def visible_gpus(devices: int) -> list[int]:
    """NVML's indexes of the first `devices` GPUs of CUDA_VISIBLE_DEVICES (NVML ignores it), so
    that a bench kept to GPU 1 of a host samples GPU 1; unset or not indexes: the first ones."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").replace(" ", "")
    if visible and all(part.isdigit() for part in visible.split(",")):
        return [int(part) for part in visible.split(",")][:devices]
    return list(range(devices))


class GpuSampler:
    """GPU utilization through NVML every 0.2 s, the mean over the first `devices` GPUs this
    process may use (nothing on a machine without NVIDIA GPUs)."""

    def __init__(self, devices: int = 1):
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in visible_gpus(devices)]
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVIDIA driver (or fewer GPUs): no figure
            self._nvml = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while self._nvml and not self._stop.wait(0.2):
            busy = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
            self.samples.append((time.time(), sum(busy) / len(busy)))

    def busy_pct(self, start: float, end: float) -> float | None:
        window = [u for t, u in self.samples if start <= t <= end]
        return round(sum(window) / len(window), 1) if window else None

    def busy_by_tenth(self, start: float, end: float) -> list[float | None]:
        """The busy figure over each tenth of the window: where a miss sits (the ramp while the
        first requests render, the steady state, the tail as the last requests drain)."""
        step = (end - start) / 10
        return [self.busy_pct(start + i * step, start + (i + 1) * step) for i in range(10)]


def server_home(work: Path) -> Path:
    """The `PREFECT_HOME` of the bench's `prefect server start` (`prefect_api`): its database is there."""
    return work / "prefect-server"


@contextmanager
def prefect_api(mode: str, work: Path):
    """The environment that points the flow phases at their Prefect API: nothing (each starts
    the embedded server) or a `prefect server start` of its own, up before the first phase and
    stopped after the last, so its start is not in any phase's wall."""
    if mode != "server":
        yield {}
        return
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(server_home(work)), "PREFECT_UI_ENABLED": "false",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    with open(work / "prefect-server.log", "wb") as log, started(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            grace=30, env=env, stdout=log, stderr=subprocess.STDOUT) as server:  # its uvicorn with it
        _wait_until(lambda: _healthy(api), server, f"prefect server did not start; see {work / 'prefect-server.log'}")
        yield {"PREFECT_API_URL": api}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def s3_source(folder: Path, work: Path):
    """The bench's items in S3 under `VLM_CAPTION_BENCH_S3` (a real endpoint: credentials and
    `VLM_CAPTION_S3_ENDPOINT_URL` from the environment), else in a loopback moto server. Either
    way the endpoint is a process of its own, as a real one is (moto's threads in the flow's
    process took its GIL from the feed: 0.71x at 1920x1080, measured), and the items are
    uploaded once, before any phase. Yields the environment that points a phase at them."""
    base = os.environ.get("VLM_CAPTION_BENCH_S3", "").rstrip("/")
    if base:
        _upload(folder, f"{base}/images/", dict(os.environ))
        yield {}
        return
    with loopback_s3(work) as env:
        _upload(folder, f"{LOOPBACK_S3}/images/", {**os.environ, **env})
        yield env


@contextmanager
def loopback_s3(work: Path):
    """A moto S3 server in a process of its own with an empty bucket `bench`; yields the
    environment that points a process at it (and this process's storage, while it lasts)."""
    port = _free_port()
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "VLM_CAPTION_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}", "VLM_CAPTION_BENCH_S3": LOOPBACK_S3}
    with open(work / "moto-server.log", "wb") as log, started(
            [sys.executable, "-m", "vlm_caption.bench.loopback_s3", "-H", "127.0.0.1", "-p", str(port)], cwd=REPO,
            stdout=log, stderr=subprocess.STDOUT) as server:
        _wait_until(lambda: _healthy(env["VLM_CAPTION_S3_ENDPOINT_URL"], path="/moto-api/"), server,
                    f"the moto S3 server did not start; see {work / 'moto-server.log'}")
        import boto3

        boto3.client("s3", endpoint_url=env["VLM_CAPTION_S3_ENDPOINT_URL"], region_name="us-east-1",
                     aws_access_key_id="bench", aws_secret_access_key="bench").create_bucket(Bucket="bench")
        from vlm_caption.bench.processes import settings_environment

        with settings_environment(env):
            yield env


def _upload(folder: Path, prefix: str, env: dict[str, str]) -> None:
    """Every file under `folder` to `prefix`, through the flow's own storage code, in a child
    process that sees the phases' environment."""
    code = ("import sys; from pathlib import Path; from vlm_caption.tasks.sources.storage import open_storage\n"
            "folder, store = Path(sys.argv[1]), open_storage(sys.argv[2], create=True)\n"
            "for path in sorted(p for p in folder.rglob('*') if p.is_file()):\n"
            "    store.write(str(path.relative_to(folder)), path.read_bytes())")
    subprocess.run([sys.executable, "-c", code, str(folder), prefix], env=env, cwd=REPO, check=True)


def _wait_until(ready, proc: subprocess.Popen, message: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not ready():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(message)
        time.sleep(1)


def _healthy(api: str, path: str = "/health") -> bool:
    import httpx

    try:
        return httpx.get(f"{api}{path}", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


BENCH_POOL = "vlm-caption-gpu"  # the pool deployments/prefect.yaml names


@contextmanager
def partition_workers(gpus: int, work: Path, api_env: dict[str, str]):
    """What a fanned-out run needs besides its server, set up as the README's "Operate it" says:
    the work pool, the partition deployment from deployments/prefect.yaml, and one process worker
    per GPU 1..N-1 (the run itself captions its partition on GPU 0). Stopped afterwards, each
    with what it started. The partition deployment reads S3 credentials from the vlm-caption-s3
    block: made here for the bench's loopback S3 server; a real endpoint's is the user's, as for
    their own deployments."""
    env = {**os.environ, **api_env, "VLM_CAPTION_HOME": str(REPO), "PREFECT_CLI_PROMPT": "false",
           "PREFECT_WORKER_QUERY_SECONDS": "2"}  # a child run starts within 2 s of being created
    env.pop("CUDA_VISIBLE_DEVICES", None)
    # Each step is a Prefect CLI process (10-20 s each on a busy 2-core machine); what does not
    # depend on another runs beside it: the credentials block beside the pool, then the
    # deployment beside the workers (which need the pool, not the deployment). Every process is
    # stopped on the way out, with what it started, however the phase ends.
    with contextlib.ExitStack() as running:
        first = [_prefect_cli(running, ["work-pool", "create", BENCH_POOL, "--type", "process", "--overwrite",
                                        "--base-job-template", "deployments/base-job-templates/process-gpu.json"], env)]
        if api_env.get("VLM_CAPTION_BENCH_S3") == LOOPBACK_S3:
            first.append(_save_loopback_credentials(running, env))
        _finish(first)
        deploying = _prefect_cli(running, ["deploy", "--prefect-file", "deployments/prefect.yaml", "--name",
                                           "partition"], env)
        for gpu in range(1, gpus):
            # SIGTERM, then SIGKILL after 5 s: its phase is over, so nothing of it is still needed; a
            # `prefect worker` answers SIGTERM by sending itself SIGINT and polling on, so a longer
            # grace was always used up (30 s of every `--gpus` bench on a 2-core machine).
            log = running.enter_context(open(work / f"worker-gpu{gpu}.log", "wb"))
            running.enter_context(started(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", BENCH_POOL, "--limit", "1",
                 "--name", f"bench-gpu{gpu}", "--type", "process"], cwd=REPO,
                env={**env, "CUDA_VISIBLE_DEVICES": str(gpu)}, stdout=log, stderr=subprocess.STDOUT))
        _finish([deploying])
        yield


def _prefect_cli(running: contextlib.ExitStack, args: list[str], env: dict[str, str]) -> tuple[str, subprocess.Popen]:
    """`prefect <args>`, started; `_finish` waits for it."""
    return _start(running, f"prefect {' '.join(args)}", ["-m", "prefect", *args], env)


def _save_loopback_credentials(running: contextlib.ExitStack, env: dict[str, str]) -> tuple[str, subprocess.Popen]:
    code = ("import os; from prefect_aws import AwsCredentials\n"
            f"AwsCredentials(aws_access_key_id=os.environ['AWS_ACCESS_KEY_ID'], "
            f"aws_secret_access_key=os.environ['AWS_SECRET_ACCESS_KEY'], region_name='us-east-1')"
            f".save({S3_BLOCK!r}, overwrite=True)")
    return _start(running, f"saving the {S3_BLOCK} block", ["-c", code], env)


def _start(running: contextlib.ExitStack, what: str, args: list[str],
           env: dict[str, str]) -> tuple[str, subprocess.Popen]:
    """This Python with `args`, started in the repository, its output kept for `_finish`, and
    stopped when `running` closes if it has not ended by then."""
    return what, running.enter_context(started([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True))


def _finish(steps: list[tuple[str, subprocess.Popen]]) -> None:
    """Wait for each started step; the first that failed raises with its output's tail."""
    outputs = [(what, proc, proc.communicate()[0]) for what, proc in steps]
    for what, proc, output in outputs:
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed:\n{output[-4000:]}")
