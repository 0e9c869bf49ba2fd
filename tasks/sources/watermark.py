"""`--modified-since`: only the objects modified after a time are listed (a time, a duration, or
`auto`: the output's watermark file, with the keys to list again): docs/sources.md, "Only what changed".
And where a job's last complete listing of a folder or bucket ended (`listed/<fingerprint>-<scope>.json`),
so that its next run can tell before it lists whether objects sort after it, and build its engine
first (`start_engine_first`). A hint only: what is done is the done-index's to say."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.sources.formats import ChangedSince, SourceSpec
from vlm_caption.tasks.sources.inventory import iso_seconds, read_report, report_series
from vlm_caption.tasks.sources.items import WorkItem
from vlm_caption.tasks.sources.storage import Storage, StorageError, key_within, open_storage, split_parent

WATERMARKS = "watermarks/"
LISTING_ENDS = "listed/"
# What the watermark stays behind what a listing saw. An object's LastModified is when its upload
# began (a long upload shows up after newer ones), and an inventory report is eventually
# consistent (a recent object may be missing from it and in the next one). Looking a day back
# costs a done-index lookup per object of that day.
MARGIN_S = 24 * 3600
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def check_modified_since(value: str | None) -> str | None:
    """The job field's value, checked (ValueError saying the forms it takes)."""
    if value is None or value == "auto" or _DURATION.fullmatch(value.strip()):
        return value if value is None else value.strip()
    try:
        iso_seconds(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a time (2026-11-20 or 2026-11-20T03:00:00Z), a duration "
                         "(26h, 90m, 2d, 1w) or auto") from None
    return value.strip()


def resolve_modified_since(value: str | None, now: float | None = None) -> str | None:
    """A duration as the time it names now (ISO, UTC); a time in the same form; `auto` as is."""
    if value is None or value == "auto":
        return value
    match = _DURATION.fullmatch(value)
    moment = (now or time.time()) - float(match[1]) * _UNIT_S[match[2]] if match else iso_seconds(value)
    return _iso(moment)


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def scoped_key(folder: str, source: SourceSpec, fingerprint: str) -> str:
    """One object under `folder` per result set and what a listing covers (its location and glob)."""
    where = report_series(source.uri) if source.format == "inventory" else source.uri
    scope = hashlib.sha256(json.dumps([where.rstrip("/"), source.glob]).encode()).hexdigest()[:12]
    return f"{folder}{fingerprint}-{scope}.json"


def with_changed_since(source: SourceSpec, modified_since: str | None, output: Storage,
                       fingerprint: str) -> SourceSpec:
    """The source, listing only what changed when the job says so (its `changed`)."""
    from vlm_caption.tasks.sources.registry import reader_class

    if modified_since is None:
        return source
    if not reader_class(source.format).timed:  # the reader's objects carry no modification time
        raise StorageError(f"{source.uri}: --modified-since is for a folder or bucket of media files and for "
                           "S3 Inventory reports, not a "
                           f"{'job manifest' if source.format == 'manifest' else source.format} source")
    as_of = read_report(source.uri).created_at if source.format == "inventory" else time.time()
    if modified_since != "auto":
        return dataclasses.replace(source, changed=ChangedSince(iso_seconds(modified_since), None, as_of))
    key = scoped_key(WATERMARKS, source, fingerprint)
    kept = _read(output.describe(key))
    after = iso_seconds(kept["modified_after"]) if "modified_after" in kept else None
    return dataclasses.replace(source, changed=ChangedSince(after, output.describe(key), as_of))


def _read(uri: str) -> dict[str, Any]:
    folder, name = split_parent(uri)
    try:
        body = open_storage(folder).read(name)
    except (FileNotFoundError, StorageError):  # none yet (a local output's watermarks/ folder is made with it)
        return {}
    try:
        return json.loads(body)
    except ValueError as exc:
        raise StorageError(f"{uri}: not a watermark ({exc}); delete it to list every object once more") from exc


def changed_items(items: Iterable[WorkItem], changed: ChangedSince) -> Iterator[WorkItem]:
    """The items with an object modified after `changed.after` (or of unknown time), and those the
    watermark keeps to be retried; the others are left out and counted in the log."""
    retry = frozenset(_read(changed.watermark).get("retry", ())) if changed.watermark else frozenset()
    after, left_out = changed.after, 0
    for item in items:
        if after is None or item.id in retry or any(m.last_modified is None or m.last_modified > after
                                                    for m in item.members):
            yield item
        else:
            left_out += 1
    get_logger().info("left out objects not modified since", modified_after=_iso(after) if after else None,
                      left_out=left_out, retried=len(retry))


def advance_watermark(output: Storage, source: SourceSpec, tally: Any, *, complete: bool) -> dict | None:
    """At the end of a run of `auto` (every partition's counts in `tally`): the watermark moved on,
    with the keys to retry, or why not (for the manifest). `complete`: every partition reported
    and no `limit` cut the listing. A failure to write is logged and reported, not raised."""
    changed = source.changed
    if changed is None or changed.watermark is None:
        return None
    failed = sum(tally.failures_by_kind.values())
    why = ("the run was cut by limit, or a partition did not report" if not complete else
           f"{failed} failures, {len(tally.failures)} listed in the manifest" if len(tally.failures) < failed
           else None)
    log = get_logger(watermark=changed.watermark)
    if why is not None:
        log.warning("watermark not moved: the next run lists from the same time", why=why)
        return {"path": changed.watermark, "moved": False, "why": why}
    after = changed.as_of - MARGIN_S
    if changed.after is not None:
        after = max(after, changed.after)
    retry = sorted({f["key"] for f in tally.failures if f.get("retryable")})
    body = {"modified_after": _iso(after), "retry": retry, "as_of": _iso(changed.as_of), "margin_s": MARGIN_S,
            "updated_at": _iso(time.time())}
    try:
        output.write(key_within(output, changed.watermark), json.dumps(body, indent=1).encode())
    except Exception as exc:  # noqa: BLE001 - logged and reported; the old watermark stands
        log.warning("watermark not written: the next run lists from the same time", error=str(exc))
        return {"path": changed.watermark, "moved": False, "why": f"not written: {exc}"}
    log.info("watermark moved", modified_after=body["modified_after"], retry=len(retry))
    return {"path": changed.watermark, "moved": True, "modified_after": body["modified_after"], "retry": len(retry)}


def listing_end_key(source: SourceSpec, fingerprint: str) -> str:
    return scoped_key(LISTING_ENDS, source, fingerprint)


def keep_listing_end(output: Storage, source: SourceSpec, fingerprint: str, greatest_key: str | None) -> None:
    """After a listing that went to the end (no `limit`): the greatest key it read (a failure logged)."""
    if greatest_key is None or source.format != "files":
        return
    body = {"greatest_key": greatest_key, "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        output.write(listing_end_key(source, fingerprint), json.dumps(body).encode())
    except Exception as exc:  # noqa: BLE001 - a hint for the next run's engine start, not a result
        get_logger(source=source.uri).warning("could not keep where the listing ended; the next run starts "
                                              "its engine at its first new item", error=str(exc))


def object_after_listing_end(output: Storage, source: SourceSpec, fingerprint: str) -> str | None:
    """The first object after the greatest key the job's last complete listing read; None where
    there is none, nothing was kept, or either could not be read (logged)."""
    if source.format != "files":  # a folder or bucket of media files, its items its objects by key
        return None
    try:
        greatest = json.loads(output.read(listing_end_key(source, fingerprint)))["greatest_key"]
        first = next(iter(source.storage.iter_objects(source.glob, start_after=greatest)), None)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a hint for when the engine starts, not what is done
        get_logger(source=source.uri).warning("could not look past where the last listing ended", error=str(exc))
        return None
    return first.key if first is not None else None
