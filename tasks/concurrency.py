"""One run of a job at a time, whatever started it (docs/operations.md, "Concurrency limits"): a
Prefect global concurrency limit named after the job's fingerprint (one slot, created when missing,
taken `strict`). The embedded server runs no repossessor and keeps its leases in the memory of the
process that died, so there the slot is also guarded by an OS file lock, which the kernel lets go
of however its holder ends: a run that holds the lock knows a slot still taken is a dead run's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from vlm_caption.tasks.errors import BusyError
from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.settings import get_settings


class JobBusyError(BusyError, RuntimeError):
    """Another run of the same job held the job's slot for longer than we would wait."""


def lease_name(fingerprint: str) -> str:
    return f"vlm-caption-job-{fingerprint}"


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says: `pid 123 since 02:14:05`."""
    try:
        pid = os.pread(fd, 32, 0).decode().split()[0]
        since = time.strftime("%H:%M:%S", time.localtime(os.fstat(fd).st_mtime))
        return f"pid {pid} since {since}"
    except (OSError, IndexError, UnicodeDecodeError):
        return "a run starting"


_held: dict[str, int] = {}  # the job lock files this process holds, by limit name: their descriptors


def hold_job_lock(fingerprint: str, output: str, say=None) -> int | None:
    """Take the job's lock file (embedded server only; None with a Prefect server, whose repossessor
    frees a dead run's slot), waiting up to VLM_CAPTION_JOB_WAIT_S while another run holds it;
    `say(line)` is told once whom it waits for. `vlm-caption run` takes it before anything starts and
    holds it until the process ends; a second call finds it held. The file, beside the Prefect home,
    holds the process id of its holder, for messages."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    name, wait_s = lease_name(fingerprint), get_settings().job_wait_s
    if PREFECT_API_URL.value() or name in _held:
        return _held.get(name)
    path = Path(PREFECT_HOME.value()) / "vlm-caption-slots" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes (PEP 446)
    try:
        deadline, said = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    get_logger(fingerprint=fingerprint).info("waiting for another run of this job",
                                                             holder=_holder(fd), wait_s=wait_s)
                    if say is not None:
                        say(f"waiting for another run of this job ({_holder(fd)}); it ends, then this one "
                            "skips what it did. Ctrl-C to stop waiting")
                    said = True
                if time.monotonic() > deadline:
                    raise _busy(name, wait_s, output, _holder(fd))
                time.sleep(1.0)
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[name] = fd
    return fd


def _busy(name: str, wait_s: float, output: str, holder: str = "") -> JobBusyError:
    return JobBusyError(
        f"another run of this job (same source, recipe, model and sampling; output {output}"
        f"{'; ' + holder if holder else ''}) has been running for over {wait_s:.0f} s. Wait for it, then run "
        f"again: what it finished is skipped. (Prefect concurrency limit {name!r}; VLM_CAPTION_JOB_WAIT_S sets "
        "the wait.)")


@contextlib.contextmanager
def one_run_per_job(fingerprint: str, output: str) -> Iterator[None]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    name = lease_name(fingerprint)
    wait_s = get_settings().job_wait_s
    log = get_logger(fingerprint=fingerprint)
    mine = name not in _held  # else the process's own lock, taken by `vlm-caption run`, stays held after
    fd = hold_job_lock(fingerprint, output)
    try:
        with get_client(sync_client=True) as client:
            try:
                limit = client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                with contextlib.suppress(ObjectAlreadyExists):  # another run created it just now
                    client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            else:
                if fd is not None and limit.active_slots:  # the lock held: no live run can hold the slot
                    client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
                    log.warning("freed the job's slot: the run that held it is gone", limit=name)
        log.info("taking the job's slot", limit=name, wait_s=wait_s)
        taken = False
        try:
            # A short lease, renewed while the run lives: a run whose host died frees the job in a minute.
            with concurrency(name, occupy=1, timeout_seconds=wait_s, strict=True, lease_duration=60):
                taken = True
                yield
        except TimeoutError as exc:
            if taken:  # the run's own time-out, not the wait for the slot
                raise
            raise _busy(name, wait_s, output) from exc
    finally:
        if fd is not None and mine:
            del _held[name]
            os.close(fd)  # lets go of the lock; the file stays (removing it would race a waiting run)
