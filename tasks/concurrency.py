"""One run of a job at a time, whatever started it.

The prod deployment's own concurrency limit covers only runs of that deployment; `vlm-caption
run`, the dev deployment or the Python flow with the same job could overlap it and caption the
same objects twice. A Prefect global concurrency limit named after the job's fingerprint (one
slot, created when missing, taken with `strict` so a missing limit is an error and not a free
pass) makes a second run wait for the first, then skip what the first did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tasks.observability import get_logger
from tasks.settings import get_settings


class JobBusyError(RuntimeError):
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


@contextlib.contextmanager
def one_run_per_job(fingerprint: str, output: str) -> Iterator[None]:
    from prefect.concurrency.sync import concurrency

    name = lease_name(fingerprint)
    wait_s = get_settings().job_wait_s
    ensure_limit(name)
    get_logger(fingerprint=fingerprint).info("taking the job's slot", limit=name, wait_s=wait_s)
    try:
        # A short lease, renewed while the run lives: a run whose host died frees the job in a minute.
        with concurrency(name, occupy=1, timeout_seconds=wait_s, strict=True, lease_duration=60):
            yield
    except TimeoutError as exc:
        raise JobBusyError(
            f"another run of this job (same source, recipe, model and sampling; output {output}) has been "
            f"running for over {wait_s:.0f} s. Wait for it, then run again: what it finished is skipped. "
            f"(Prefect concurrency limit {name!r}; VLM_CAPTION_JOB_WAIT_S sets the wait.)") from exc
