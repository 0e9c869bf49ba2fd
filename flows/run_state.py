"""How a run looks in Prefect's UI: its name (`<recipe> · <source>`, whatever its parameters), and
how a user error ends it (docs/operations.md, "Retries and permanent errors"). Prefect 3.8 retries
every failed flow run alike (its RetryFailedFlows rule reads the run's `empirical_policy.retries`, not
the state), so a permanent error (tasks/errors.py) takes the run's retries away first (the client's
`update_flow_run`), then ends the run Failed with its line; a transient one is raised, to the retry."""

from __future__ import annotations

from typing import Any

from vlm_caption.tasks.errors import UserError


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
    away (the caller of the flow, e.g. the CLI, gets `exc` raised back)."""
    from prefect import get_run_logger
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run
    from prefect.states import Failed

    message = one_line(exc)
    get_run_logger().error(message)
    try:
        if flow_run.id:
            with get_client(sync_client=True) as client:
                run = client.read_flow_run(flow_run.id)
                if run.empirical_policy.retries:
                    client.update_flow_run(flow_run.id, empirical_policy=run.empirical_policy.model_copy(
                        update={"retries": 0}))
    except Exception as error:  # noqa: BLE001 - then Prefect retries it once more; the message stands
        get_run_logger().warning(f"could not take the run's retries away ({type(error).__name__}: {error}); "
                                 f"it may be retried once: {message}")
    return Failed(message=message, data=exc)


def validation_lines(exc) -> list[str]:
    """A pydantic ValidationError as the user's mistakes, one line each: the field and what to do,
    without pydantic's echo of every job field and its documentation link."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error.get("loc", ()))
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {message}" if where else message)
    return lines


VALIDATION_FAILED = "Validation of flow parameters failed"  # Prefect's state message


def on_run_failed(flow, flow_run, state) -> None:
    """on_failure: a run whose parameters failed validation was neither named (Prefect names a
    run after validating them) nor given a readable message (Prefect's is pydantic's, over
    several lines): both from the parameters as given, its message what is wrong with its job."""
    from prefect.client.orchestration import get_client
    from prefect.states import Failed
    from pydantic import ValidationError

    from vlm_caption.flows.params import CaptionJob

    wanted = run_name_from(flow_run.parameters)
    with get_client(sync_client=True) as client:
        if not flow_run.name.startswith(wanted.split(" [")[0]):
            client.set_flow_run_name(flow_run.id, wanted)
        if not (state.message or "").startswith(VALIDATION_FAILED):
            return
        try:
            CaptionJob.model_validate((flow_run.parameters or {}).get("job"))
            return
        except ValidationError as exc:
            message = "; ".join(validation_lines(exc))
        except UserError as exc:
            message = one_line(exc)
        client.set_flow_run_state(flow_run.id, Failed(message=f"invalid job: {message}"), force=True)
