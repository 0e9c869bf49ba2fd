"""Where a job's last complete listing of a folder or bucket ended (`listed/<fingerprint>-<scope>
.json` in the output, the scope a watermark's), so that its next run can tell before it lists
whether objects sort after it, and build its engine first (`start_engine_first`,
docs/architecture.md). A hint only: what is done is the done-index's to say.
"""

from __future__ import annotations

import json
import time

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.sources.formats import SourceSpec
from vlm_caption.tasks.sources.storage import Storage
from vlm_caption.tasks.sources.watermark import scoped_key

LISTING_ENDS = "listed/"


def listing_end_key(source: SourceSpec, fingerprint: str) -> str:
    return scoped_key(LISTING_ENDS, source, fingerprint)


def lists_objects(source: SourceSpec) -> bool:
    """A folder or bucket of media files, whose items are its objects listed by key."""
    return source.format == "files"


def keep_listing_end(output: Storage, source: SourceSpec, fingerprint: str, greatest_key: str | None) -> None:
    """After a listing that went to the end (no `limit`): the greatest key it read (a failure logged)."""
    if greatest_key is None or not lists_objects(source):
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
    if not lists_objects(source):
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
