"""What the tests look for among this test process's children and Prefect's objects."""

from __future__ import annotations

import os
from pathlib import Path

IDLE_POOL = "no-workers-here"


def engine_core_pids() -> list[int]:
    """vLLM's engine-core processes started by this test process."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"EngineCore" in cmdline:
            found.append(int(stat.parent.name))
    return found


def idle_partition_deployment(name: str, pool: str = IDLE_POOL) -> str:
    """A partition deployment on a work pool that no worker polls: the children a run asks for
    there run in the parent (tasks/fanout.py takes over children no worker started)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"), overwrite=True)
        flow_id = client.create_flow_from_name("vlm-caption")
        client.create_deployment(flow_id=flow_id, name=name, work_pool_name=pool,
                                 entrypoint="flows/caption.py:vlm_caption")
    return f"vlm-caption/{name}"
