"""How a run looks in Prefect's UI: its name (`<recipe> · <source>`, whatever its parameters),
and how a user error ends it (one line, and at once when a retry would only repeat it).

A deployment's runs carry `PREFECT_FLOWS_DEFAULT_RETRIES` (deployments/prefect.yaml), so a
crashed host, an engine that died or a lost API is run again. Prefect 3.8 retries every failed
flow run alike (the server's RetryFailedFlows rule reads the run's `empirical_policy.retries`,
not the state), so a permanent error (tasks/errors.py: a missing model, a pre-flight problem)
sets the run's retries to none first, through the client's public `update_flow_run`, then
ends the run with a Failed state whose message is the error's line: no AwaitingRetry holding
the worker's slot, no traceback in the run's logs. A transient user error (tasks/errors.py:
`permanent = False`) is raised as any exception is, to Prefect's retry.
"""

from __future__ import annotations

from typing import Any

from tasks.errors import UserError


def run_label(job: Any) -> str:
    """`<recipe> · <source>`, and `[i/N]` for a partition of a fanned-out run. `job` is a job's
    fields, as given (a run whose parameters did not validate is named from them too)."""
    if hasattr(job, "model_dump"):
        job = job.model_dump()
    if not isinstance(job, dict):
        return f"vlm-caption · invalid job {str(job)[:60]!r}"
    name = f"{job.get('recipe') or 'llava'} · {job.get('source') or job.get('manifest') or '?'}"
    part = job.get("partition")
    if isinstance(part, dict) and isinstance(part.get("index"), int) and part.get("count"):
        return f"{name} [{part['index'] + 1}/{part['count']}]"
    return name


def run_name_from(parameters: dict) -> str:
    return run_label((parameters or {}).get("job", {}))


def one_line(exc: BaseException) -> str:
    if isinstance(exc, UserError):
        return "; ".join(exc.lines())
    return f"{type(exc).__name__}: {exc}"


def fail_run(exc: UserError):
    """The Failed state a flow returns for a permanent user error, after taking the run's retries
    away (the caller of the flow, e.g. the CLI, gets `exc` raised back). A transient one is
    raised instead, to Prefect's own retry."""
    from prefect import get_run_logger
    from prefect.states import Failed

    message = one_line(exc)
    get_run_logger().error(message)
    _no_retries(message)
    return Failed(message=message, data=exc)


def _no_retries(why: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id:
        return
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(flow_run.id)
            if run.empirical_policy.retries:
                client.update_flow_run(flow_run.id, empirical_policy=run.empirical_policy.model_copy(
                    update={"retries": 0}))
    except Exception as exc:  # noqa: BLE001 - then Prefect retries it once more; the message stands
        from prefect import get_run_logger

        get_run_logger().warning(f"could not take the run's retries away ({type(exc).__name__}: {exc}); "
                                 f"it may be retried once: {why}")


def name_failed_run(flow, flow_run, state) -> None:
    """on_failure: a run whose parameters failed validation never got its name (Prefect names a
    run after validating them); name it from the parameters as given."""
    wanted = run_name_from(flow_run.parameters)
    if flow_run.name == wanted or flow_run.name.startswith(wanted.split(" [")[0]):
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.set_flow_run_name(flow_run.id, wanted)
