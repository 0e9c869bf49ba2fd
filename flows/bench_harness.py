"""What surrounds the bench's phases: GPU utilization sampled through NVML while a phase runs,
and the Prefect API the flow phases talk to (the embedded server, or one `prefect server
start` of the bench's own)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path


class GpuSampler:
    """GPU utilization through NVML every 0.2 s (nothing on a machine without NVIDIA GPUs)."""

    def __init__(self):
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVIDIA driver: no figure
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
            self.samples.append((time.time(), self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))

    def busy_pct(self, start: float, end: float) -> float | None:
        window = [u for t, u in self.samples if start <= t <= end]
        return round(sum(window) / len(window), 1) if window else None


@contextmanager
def prefect_api(mode: str, work: Path):
    """The environment that points the flow phases at their Prefect API: nothing (each starts
    the embedded server) or a `prefect server start` of its own, up before the first phase and
    stopped after the last, so its start is not in any phase's wall."""
    if mode != "server":
        yield {}
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    api = f"http://127.0.0.1:{port}/api"
    log = open(work / "prefect-server.log", "wb")
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect-server"), "PREFECT_UI_ENABLED": "false",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while not _healthy(api):
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"prefect server did not start; see {work / 'prefect-server.log'}")
            time.sleep(1)
        yield {"PREFECT_API_URL": api}
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def _healthy(api: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{api}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
