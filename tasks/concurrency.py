"""One run of a job at a time, whatever started it.

The prod deployment's own concurrency limit covers only runs of that deployment; `vlm-caption
run`, the dev deployment or the Python flow with the same job could overlap it and caption the
same objects twice. A Prefect global concurrency limit named after the job's fingerprint (one
slot, created when missing, taken with `strict` so a missing limit is an error and not a free
pass) makes a second run wait for the first, then skip what the first did.

A run that dies holding the slot (killed, out of memory) frees it when its 60 s lease expires,
which Prefect's server does in its repossessor service. The embedded server that `vlm-caption
run` starts without `PREFECT_API_URL` runs no such service and keeps leases in its own memory,
so there the run also records its process id beside the Prefect home; a later run that finds
the slot taken by a process that is gone frees it instead of waiting for hours.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from tasks.errors import BusyError
from tasks.observability import get_logger
from tasks.settings import get_settings


class JobBusyError(BusyError, RuntimeError):
    """Another run of the same job held the job's slot for longer than we would wait."""


def lease_name(fingerprint: str) -> str:
    return f"vlm-caption-job-{fingerprint}"


def ensure_limit(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another run created it just now
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))


def holder_file(name: str) -> Path | None:
    """Where a run on the embedded server records its process id while it holds the job's slot
    (None with a Prefect server, whose repossessor frees a dead run's slot)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    if PREFECT_API_URL.value():
        return None
    return Path(PREFECT_HOME.value()) / "vlm-caption-slots" / f"{name}.pid"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def free_slot_of_a_dead_run(name: str, log) -> bool:
    """On the embedded server: free the job's slot if the process that took it is gone."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    path = holder_file(name)
    pid = _recorded_pid(path) if path is not None else None
    if pid is None or _alive(pid):
        return False
    with get_client(sync_client=True) as client:
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
    path.unlink(missing_ok=True)
    log.warning("freed the job's slot: the run that held it is gone", limit=name, pid=pid)
    return True


@contextlib.contextmanager
def _holding(name: str) -> Iterator[None]:
    path = holder_file(name)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        if _recorded_pid(path) == os.getpid():  # a later run may have freed and taken the slot
            with contextlib.suppress(OSError):
                path.unlink()


def _recorded_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def one_run_per_job(fingerprint: str, output: str) -> Iterator[None]:
    from prefect.concurrency.sync import concurrency

    name = lease_name(fingerprint)
    wait_s = get_settings().job_wait_s
    log = get_logger(fingerprint=fingerprint)
    ensure_limit(name)
    free_slot_of_a_dead_run(name, log)
    log.info("taking the job's slot", limit=name, wait_s=wait_s)
    try:
        # A short lease, renewed while the run lives: a run whose host died frees the job in a minute.
        with concurrency(name, occupy=1, timeout_seconds=wait_s, strict=True, lease_duration=60), _holding(name):
            yield
    except TimeoutError as exc:
        raise JobBusyError(
            f"another run of this job (same source, recipe, model and sampling; output {output}) has been "
            f"running for over {wait_s:.0f} s. Wait for it, then run again: what it finished is skipped. "
            f"(Prefect concurrency limit {name!r}; VLM_CAPTION_JOB_WAIT_S sets the wait.)") from exc
