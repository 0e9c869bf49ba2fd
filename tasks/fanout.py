"""Fan-out over GPU workers: child runs of the partition deployment, started and awaited
(docs/operations.md, "Fan-out over several GPUs"). A child that no worker has picked up by the time
the parent has finished is claimed by the parent (so no worker starts it later) and run there.
"""

from __future__ import annotations

import contextvars
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from vlm_caption.tasks.errors import FanOutFailure
from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.shard_plan import POLL_S as PLAN_POLL_S, chunk_name, plan_prefix
from vlm_caption.tasks.sources.storage import Storage

POLL_S = 5.0
# The run ends up to one poll after its last child: a read per child a second is cheap beside that.
CHILD_POLL_S = 1.0


class FanOutError(FanOutFailure, RuntimeError):
    """Fan-out cannot start (no such deployment) or a child partition did not complete."""


@dataclass(frozen=True)
class ChildRun:
    index: int
    flow_run_id: str
    name: str


def wait_for_orphans(deployment: str, output: str, fingerprint: str) -> None:
    """Let children of an earlier run of this job (a parent that died) finish before starting new ones,
    which would caption their objects twice; once they are done, the new run skips what they did."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId, FlowRunFilterState

    log = get_logger()
    with get_client(sync_client=True) as client:
        try:
            deployment_id = client.read_deployment_by_name(deployment).id
        except ObjectNotFound:  # said at the run's start, whether or not the children are needed tonight
            raise _no_deployment(deployment) from None
        live = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]),
                             state=FlowRunFilterState(type={"any_": ["SCHEDULED", "PENDING", "RUNNING"]}))
        while True:
            orphans = [str(run.id) for run in client.read_flow_runs(flow_run_filter=live)
                       if (job := run.parameters.get("job") or {}).get("output") == output
                       and (job.get("partition") or {}).get("fingerprint") == fingerprint]
            if not orphans:
                return
            log.info("waiting for partitions of an earlier run of this job", flow_runs=orphans)
            time.sleep(POLL_S)


def start_children(deployment: str, child_jobs: dict[int, dict[str, Any]], label: Callable[[dict], str],
                   attempt: int, parent_run_id: str) -> list[ChildRun]:
    """One child flow run per partition, named by `label` (the flow's run-name rule), not waited for."""
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
            raise _no_deployment(deployment) from None
        children.append(ChildRun(index, str(flow_run.id), name))
    get_logger().info("started child partitions", deployment=deployment, children=len(children))
    return children


def _no_deployment(deployment: str) -> FanOutError:
    return FanOutError(f"fan_out needs the deployment {deployment!r}, which does not exist: run "
                       "`prefect deploy --all --prefect-file deployments/prefect.yaml`, or set fan_out=1")


class ChildrenOnWork:
    """The children, asked for once the run's shard plan holds a shard (a chunk with a line after
    its header, or an `end.json` counting shards), watched from a thread while this process lists
    and captions as partition 0. A plan that ends with no shard, or a partition 0 that finished
    first, starts none. `stop()` ends the watch and returns the children started (or raises what
    starting them raised)."""

    def __init__(self, out: Storage, run_id: str, start: Callable[[], list[ChildRun]]):
        self.out, self.run_id, self.start_them = out, run_id, start
        self._children: Future[list[ChildRun]] = Future()
        self._stop = threading.Event()
        # In this flow run's context: the children are linked to it in the UI as when asked at once.
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._watch,), name="children-on-work", daemon=True)

    def start(self) -> ChildrenOnWork:
        self._thread.start()
        return self

    def stop(self) -> list[ChildRun]:
        self._stop.set()
        self._thread.join()
        return self._children.result()

    def _watch(self) -> None:
        try:
            self._children.set_result(self.start_them() if self._wait_for_work() else [])
        except BaseException as exc:  # noqa: BLE001 - handed to stop(), in the run's own thread
            self._children.set_exception(exc)

    def _wait_for_work(self) -> bool:
        prefix, read = plan_prefix(self.run_id), 0
        while not self._stop.is_set():
            names = {ref.key[len(prefix):] for ref in self.out.iter_objects(prefix=prefix)}
            while chunk_name(read) in names:
                if b"\n" in self.out.read(prefix + chunk_name(read)).strip():  # a header, then shards
                    return True
                read += 1
            if "end.json" in names:
                return json.loads(self.out.read(prefix + "end.json")).get("shards", 0) > 0
            if "failed.json" in names:
                return False  # partition 0 stops with the listing's error
            self._stop.wait(PLAN_POLL_S)
        return False


TAKEN_OVER = "no worker started this partition in time; the parent run captions it"
CALLED_OFF = "the parent run failed before a worker started this partition; its retry starts it again"


def wait_for_children(children: list[ChildRun], run_here: Callable[[ChildRun], str] | None = None,
                      claim_message: str = TAKEN_OVER) -> dict[int, str]:
    """Each child's final state name, waited for. With `run_here`, a child still waiting for a worker is
    claimed (`claim_unstarted`) and handed to `run_here`, which returns the partition's state. A child
    whose worker died stays RUNNING until the zombie automation (deployments/automations.yaml) marks it
    CRASHED."""
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
                time.sleep(CHILD_POLL_S)
    return states


def claim_unstarted(client, child: ChildRun, message: str = TAKEN_OVER) -> bool:
    """Take over a child that no worker has started: the claim a worker makes (a proposed PENDING, granted
    to one proposer only), then CANCELLED with a `message` saying who captions its partition, if anyone."""
    from prefect.client.schemas.responses import SetStateStatus
    from prefect.states import Cancelled, Pending

    if client.set_flow_run_state(child.flow_run_id, Pending()).status != SetStateStatus.ACCEPT:
        return False
    client.set_flow_run_state(child.flow_run_id, Cancelled(message=message), force=True)
    return True
