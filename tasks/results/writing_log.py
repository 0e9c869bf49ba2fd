"""When each writer wrote results parts: what lets a done-index load list only the parts written
since its compacted index, never the whole history (tasks/results/done_rows.py reads it).

Part names do not sort by when they were written (`part-<run id>-<shard>`, a run id begins with
8 random hex digits, and a run writes for hours under its start's stamp), so a listing that
starts after a key cannot find new parts by their names. Instead each writer (a run, or a
partition of a fanned-out one: its parts_id) leaves empty objects whose names sort by time,
`results/<fp>/writing/<UTC stamp>-<parts_id>`, one every few minutes while it writes.

The writer's rule (tasks/results/writers.py calls these around each part and its sidecar):
before the write (`before_part`), unless the last stamp this process wrote for the writer was
taken less than REFRESH_S ago, it writes a fresh one; after the write, done or failed (a failed
PUT may have landed; `after_part`), it does the same unless the last is less than WRITE_S old;
a stamp whose own write took longer than WRITE_S is written again. So:

  (W) for every part P, its writer has a stamp s >= T(P) - WRITE_S that landed by s + WRITE_S,

T(P) the time P last landed (the check after the write runs after it; the stamp it finds or
writes is at most WRITE_S old then, and landed within WRITE_S of being taken). The stamp before
the write keeps (W) for a writer killed just after its part landed, unless that write itself
took longer than WRITE_S - REFRESH_S (then the shard is computed again by the next run or
another partition, as for a writer killed before its write: results twice, never lost).

A load (done_rows.load_part_rows) starting at wall time t lists `writing/` after the stamp
`after` of the compacted index it reads, lists the parts of each writer found there (their own
prefix, a page for a night's run), reads what it does not hold, and its compacted index records
`after' = stamp(t - GRACE_S)`. The invariant, for every compacted index:

  (I) every part that index does not hold (with its current size) has a stamp > its `after`.

A load that lists the whole of results/<fp>/ (no usable index: the first, or a damaged one)
makes it true: a part it did not list landed after t, so by (W) has a stamp
>= t - WRITE_S > after'. An incremental load keeps it: take a part P it does not hold as P is
now. If the index it read did not hold P as it is now either, by (I) P has a stamp s > after.
If s had landed when the load listed `writing/`, the load listed P's writer after t and did not
see P as it is now: P landed after t, and by (W) has a stamp > after'. If s had not landed then,
s > (that listing's time) - WRITE_S >= t - WRITE_S > after'. If the index it read held P as it
is now, the load holds it too, unless it listed P's writer and found P gone or of another size
(then it read P again). Parts the load could not read are kept by name in its index and tried
again by the next load.

Removal: stamps would otherwise pile up (a writer leaves one every few minutes, every night), so
a load that writes a compacted index removes the stamps no load can still need. Each index carries
its lineage, the write stamps of the indexes before it (`index-<stamp>-<tag>.vidx`), trimmed to
those less than KEEP_S old and the newest older one, G. Assume a load ends within KEEP_S of its
start. A load still running started less than KEEP_S ago, after G was written, so it read G or an
index written after it; any such index was made by a load that began at most KEEP_S before its
write, so its `after` is at least stamp(G) - KEEP_S - GRACE_S, less the clocks' skew (under
GRACE_S). A stamp at or before stamp(G) - KEEP_S - 2 GRACE_S is listed by no load again. A load
removes at most REMOVE_MAX of them, several at a time (they overlap the engine's start); the rest
go at the next compaction. Removing is best effort: a stamp left behind costs nothing but its name.

Clocks: the loader's and the writers' clocks may each be off by up to (GRACE_S - WRITE_S) / 2
(27 minutes; AWS S3 refuses a request whose clock is 15 minutes off). Concurrent writers (the
partitions of a run, a run dying while another starts) and concurrent loads and compactions are
covered: every compacted index satisfies (I) on its own. Not seen without a full listing: a part
deleted or rewritten by hand (not by a run) once no run's stamp since its index names its
writer; deleting the compacted indexes (`results/<fp>/index-*.vidx`) makes the next load list
everything again.
"""

from __future__ import annotations

import calendar
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from vlm_caption.tasks.results.layout import STAMP, STAMP_LEN, stamp, writing_key, writing_prefix
from vlm_caption.tasks.sources.storage import Storage

WRITE_S = 300.0  # a stamp older than this no longer vouches for a part landing now
REFRESH_S = WRITE_S / 2  # a writer writes a stamp at most every REFRESH_S (while it writes parts)
GRACE_S = 3600.0  # a compacted index lists `writing/` from this long before its load began
KEEP_S = 7 * 86400.0  # a done-index load ends within this long of its start (see Removal above)
REMOVE_MAX = 2000  # stamps one load removes at most
REMOVERS = 16  # parallel deletes

_lock = threading.Lock()
_last: dict[tuple[str, str, str], float] = {}  # (output, fingerprint, parts_id) -> monotonic time of its stamp


def before_part(out: Storage, fingerprint: str, parts_id: str) -> None:
    """Before a part of `parts_id` is written: a stamp less than REFRESH_S old."""
    _stamped(out, fingerprint, parts_id, REFRESH_S)


def after_part(out: Storage, fingerprint: str, parts_id: str) -> None:
    """After a part of `parts_id` (and its sidecar) landed, or may have: keep (W) true."""
    _stamped(out, fingerprint, parts_id, WRITE_S)


def _stamped(out: Storage, fingerprint: str, parts_id: str, max_age: float) -> None:
    key = (out.uri, fingerprint, parts_id)
    with _lock:
        last = _last.get(key)
    if last is not None and time.monotonic() - last <= max_age:
        return
    while True:
        taken = time.monotonic()
        out.write(writing_key(fingerprint, stamp(time.time()), parts_id), b"")
        if time.monotonic() - taken <= WRITE_S:  # it landed within WRITE_S of its stamp
            break
    with _lock:
        _last[key] = max(taken, _last.get(key, taken))


def writers_since(out: Storage, fingerprint: str, after: str) -> set[str]:
    """The parts_ids with a stamp later than `after` (a listing of `writing/` from there)."""
    prefix = writing_prefix(fingerprint)
    names = (ref.key[len(prefix):] for ref in out.iter_objects(prefix=prefix, start_after=prefix + after))
    return {name.split("-", 1)[1] for name in names if "-" in name}


def grace_stamp(started: float) -> str:
    """The `after` of a compacted index made by a load that began at wall time `started`."""
    return stamp(started - GRACE_S)


def kept_lineage(lineage: list[str], now: float) -> tuple[list[str], str | None]:
    """What a new index keeps of `lineage` (the write stamps of the indexes before it): those less
    than KEEP_S old and the newest older one, G; and the latest stamp no load can still list
    from (see Removal above), or None while no index in it is KEEP_S old."""
    cutoff = stamp(now - KEEP_S)
    older = sorted(written for written in lineage if written <= cutoff)
    kept = sorted(set(older[-1:] + [written for written in lineage if written > cutoff]))
    if not older:
        return kept, None
    return kept, stamp(calendar.timegm(time.strptime(older[-1], STAMP)) - KEEP_S - 2 * GRACE_S)


def remove_stamps(out: Storage, fingerprint: str, through: str) -> tuple[int, int]:
    """Remove up to REMOVE_MAX stamps taken at or before `through`; returns how many went and how
    many could not be removed (left for the next compaction)."""
    prefix = writing_prefix(fingerprint)
    old = []
    for ref in out.iter_objects(prefix=prefix):  # in key order: the oldest first
        if ref.key[len(prefix):][:STAMP_LEN] > through or len(old) >= REMOVE_MAX:
            break
        old.append(ref.key)
    if not old:
        return 0, 0
    with ThreadPoolExecutor(max_workers=min(REMOVERS, len(old))) as pool:
        removed = sum(pool.map(lambda key: _deleted(out, key), old))
    return removed, len(old) - removed


def _deleted(out: Storage, key: str) -> bool:
    try:
        out.delete(key)
        return True
    except Exception:  # noqa: BLE001 - counted as not removed (the caller logs the count); tried again later
        return False
