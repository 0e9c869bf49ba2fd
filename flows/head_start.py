"""A nightly run's head start (docs/architecture.md, "The engine starts first"): `vlm-caption run` begins
the done-index's load and the listing on a thread once its plan is made; the flow takes them in its
`load-done-index` and `list-source` task runs, or drops them where another run may have outdated the load."""

from __future__ import annotations

import functools
import threading

from prefect import task
from prefect.cache_policies import NONE

from vlm_caption.flows.plan import RunPlan
from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.results.done_index import DoneIndex, load_done_index
from vlm_caption.tasks.results.layout import manifest_key
from vlm_caption.tasks.sources.listing import ShardStream
from vlm_caption.tasks.sources.watermark import keep_listing_end

# Taking a free slot asks the server a few times; a slot that took longer was held by another run.
SLOT_FREE_S = 5.0
MANIFESTS = manifest_key("").rsplit("/", 1)[0] + "/"


class HeadStart:
    """The done-index's load, then the listing judged against it, on a thread begun before the flow."""

    def __init__(self, plan: RunPlan):
        self.plan = plan
        self.done: DoneIndex | None = None
        self.error: BaseException | None = None
        self.manifests: frozenset[str] | None = None  # the output's manifests before the load
        self.loaded = threading.Event()
        job = plan.job
        self.stream = ShardStream(plan.source, job.shard_size, job.limit,
                                  pending=lambda items: self.done.pending_mask(items, job.questions_to_ask),
                                  on_end=functools.partial(keep_listing_end, plan.output, plan.source, plan.fingerprint))
        self.thread = threading.Thread(target=self._load_then_list, name="vlm-caption-head-start", daemon=True)

    def _load_then_list(self) -> None:
        try:
            self.manifests = manifests_of(self.plan)
            # The task's body, which also keeps the index for the run's Parquet step.
            self.done = load_done_index.fn(self.plan.output, self.plan.fingerprint)
        except BaseException as exc:  # noqa: BLE001 - the flow loads it itself, with the task's retries
            self.error = exc
        finally:
            self.loaded.set()
        if self.error is None:
            self.stream.begin()

    def outdated(self) -> str | None:
        """Why the output may hold results this load has not (a run ended meanwhile), or None."""
        self.loaded.wait()
        try:
            if self.manifests is not None and manifests_of(self.plan) != self.manifests:
                return "another run of the job ended meanwhile"
        except Exception as exc:  # noqa: BLE001 - unsure: loaded again
            return f"the output's manifests could not be listed ({exc})"
        return None

    def drop(self, wait: bool = True) -> None:
        """Not taken: the listing stopped; with `wait`, the load waited for, so that an index
        loaded after this one is the one kept for the run's Parquet step."""
        self.stream.close()
        if wait:
            self.loaded.wait()
            self.stream.close()  # begun after the first close, if the load ended in between


_started: HeadStart | None = None  # begun by `vlm-caption run`, not taken or dropped yet
_lock = threading.Lock()


def _pop() -> HeadStart | None:
    global _started
    with _lock:
        head, _started = _started, None
    return head


def manifests_of(plan: RunPlan) -> frozenset[str]:
    return frozenset(ref.key for ref in plan.output.iter_objects(prefix=MANIFESTS))


def begin_head_start(plan: RunPlan) -> bool:
    """`vlm-caption run`, for a job whose output holds results of it (the caller knows it starts no
    engine first): the load and the listing begun now, for a run of its own (no fan-out, not a
    partition). True if begun."""
    global _started
    if plan.job.fan_out > 1 or plan.job.partition is not None:
        return False
    with _lock:
        if _started is not None:
            return False
        _started = head = HeadStart(plan)
    head.thread.start()
    return True


def settle_head_start(plan: RunPlan, slot_wait_s: float) -> None:
    """Once the flow holds the job's slot: drop a head start another run's results may have
    outdated (the slot was held by another run, or a run ended and wrote its manifest), or one
    begun for another job than the flow resolved (a newer inventory report since)."""
    head = _started
    if head is None:
        return
    if head.plan.job.model_dump_json() != plan.job.model_dump_json():
        why = "the flow's job is not the one begun"
    elif slot_wait_s > SLOT_FREE_S:
        why = f"the job's slot took {slot_wait_s:.1f} s (another run held it)"
    else:
        why = head.outdated()
    if why is not None and _pop() is head:
        head.drop()
        get_logger(fingerprint=head.plan.fingerprint).info("done-index loaded again", why=why)


def discard_head_start() -> None:
    """Drop a head start left as `vlm-caption run`'s flow has ended (it failed before its
    listing): nothing loads after it, so nothing is waited for."""
    if (head := _pop()) is not None:
        head.drop(wait=False)


def take_head_start() -> tuple[DoneIndex, ShardStream] | None:
    """The done-index and begun listing of a run not fanned out, once, where the flow kept them;
    None where there is none or its load failed (the caller loads and lists as usual)."""
    head = _pop()
    if head is None:
        return None
    done = wait_for_done_index(head)
    if done is None:
        head.drop()
        return None
    return done, head.stream.start()


@task(name="load-done-index", cache_policy=NONE, persist_result=False)
def wait_for_done_index(head: HeadStart) -> DoneIndex | None:
    """The done-index the head start is loading, once it is loaded."""
    head.loaded.wait()
    if head.error is not None:
        get_logger(fingerprint=head.plan.fingerprint).warning(
            "the done-index's early load failed; loading it again", error=str(head.error))
    return head.done
