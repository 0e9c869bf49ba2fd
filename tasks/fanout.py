"""Fan-out over GPU workers: child runs of the partition deployment, started and awaited.

A parent run with `fan_out=N` starts partitions 1..N-1 as child flow runs (`run_deployment`,
linked to the parent in the UI) on the partition deployment's work pool, where one worker per
GPU picks each up, and captions partition 0 itself. The partitions share the shards by claiming
them in the output store (tasks/claims.py), so the runs never overlap; each child writes a
report, and the parent writes the one manifest of the run.

A child that no worker has picked up by the time the parent has finished is claimed by the
parent (so no worker starts it later) and run there, where it finds every shard taken: a run
completes with fewer live workers than partitions, or none besides the parent's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from tasks.errors import FanOutFailure
from tasks.observability import get_logger

POLL_S = 5.0


class FanOutError(FanOutFailure, RuntimeError):
    """Fan-out cannot start (no such deployment) or a child partition did not complete."""


@dataclass(frozen=True)
class ChildRun:
    index: int
    flow_run_id: str
    name: str


def wait_for_orphans(deployment: str, output: str, fingerprint: str, poll_s: float = POLL_S) -> None:
    """Let children of an earlier run of this job finish before starting new ones.

    A child whose parent died keeps captioning its slice. Starting a new child for the same
    slice meanwhile would caption objects twice; once the orphan is done, its parts are on the
    done-index and the new run skips them."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId, FlowRunFilterState

    log = get_logger()
    with get_client(sync_client=True) as client:
        try:
            deployment_id = client.read_deployment_by_name(deployment).id
        except ObjectNotFound:
            return  # start_children says what to do about it
        live = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
                             state=FlowRunFilterState(type={"any_": ["SCHEDULED", "PENDING", "RUNNING"]}))
        while True:
            orphans = [run for run in client.read_flow_runs(flow_run_filter=live)
                       if _same_job(run.parameters.get("job") or {}, output, fingerprint)]
            if not orphans:
                return
            log.info("waiting for partitions of an earlier run of this job",
                     flow_runs=[str(run.id) for run in orphans])
            time.sleep(poll_s)


def _same_job(job: dict[str, Any], output: str, fingerprint: str) -> bool:
    return job.get("output") == output and (job.get("partition") or {}).get("fingerprint") == fingerprint


def start_children(deployment: str, child_jobs: dict[int, dict[str, Any]], label: Callable[[dict], str],
                   attempt: int, parent_run_id: str) -> list[ChildRun]:
    """Create one child flow run per partition and return without waiting for them.

    Each is named by `label` (the flow's own run-name rule) so it reads right before it starts."""
    children = []
    for index, job in child_jobs.items():
        name = label(job)
        try:
            flow_run = run_deployment(
                deployment, parameters={"job": job}, flow_run_name=name, timeout=0,
                tags=["vlm-caption-partition"],
                # A retried parent starts fresh children; a repeated call within one attempt does not.
                idempotency_key=f"{parent_run_id}-attempt{attempt}-p{index}",
            )
        except ObjectNotFound:
            raise FanOutError(
                f"fan_out needs the deployment {deployment!r}, which does not exist: run "
                "`prefect deploy --all --prefect-file deployments/prefect.yaml`, or set fan_out=1"
            ) from None
        children.append(ChildRun(index, str(flow_run.id), name))
    get_logger().info("started child partitions", deployment=deployment, children=len(children))
    return children


TAKEN_OVER = "no worker started this partition in time; the parent run captions it"
CALLED_OFF = "the parent run failed before a worker started this partition; its retry starts it again"


def wait_for_children(children: list[ChildRun], run_here: Callable[[ChildRun], str] | None = None,
                      poll_s: float = POLL_S, claim_message: str = TAKEN_OVER) -> dict[int, str]:
    """Block until every child reaches a final state; return each one's state name.

    With `run_here`, a child still waiting for a worker is claimed (marked CANCELLED with
    `claim_message`) and handed to `run_here`, which captions it in this process, or not, and
    returns the partition's state. A child whose worker died stays RUNNING until Prefect marks
    it CRASHED (the zombie automation in deployments/automations.yaml does that from missed
    heartbeats)."""
    log = get_logger()
    states: dict[int, str] = {}
    with get_client(sync_client=True) as client:
        while len(states) < len(children):
            for child in children:
                if child.index in states:
                    continue
                flow_run = client.read_flow_run(child.flow_run_id)
                if flow_run.state is not None and flow_run.state.is_final():
                    states[child.index] = flow_run.state.type.value
                    log.info("child partition finished", partition=child.index,
                             state=states[child.index], flow_run_id=child.flow_run_id)
                elif run_here is not None and flow_run.state is not None and flow_run.state.is_scheduled() \
                        and claim_unstarted(client, child, claim_message):
                    log.warning("a child partition that no worker started is taken back", reason=claim_message,
                                partition=child.index, flow_run_id=child.flow_run_id)
                    states[child.index] = run_here(child)
            if len(states) < len(children):
                time.sleep(poll_s)
    return states


def claim_unstarted(client, child: ChildRun, message: str = TAKEN_OVER) -> bool:
    """Take over a child that no worker has started. The claim is the one a worker makes (a
    proposed PENDING, which the server grants to one proposer only), so a worker picking the
    run up at the same moment gets it or we do, never both. The claimed run is then marked
    CANCELLED with a message that says who captions its partition (or why nobody does)."""
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import Cancelled, Pending

    if client.set_flow_run_state(child.flow_run_id, Pending()).status != SetStateStatus.ACCEPT:
        return False
    client.set_flow_run_state(child.flow_run_id, Cancelled(message=message), force=True)
    return True
