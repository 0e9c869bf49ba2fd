"""What an item brings besides its media, put into its records: a WebDataset sample's
`.json`/`.txt` or a Parquet row's other columns (`metadata`), and damage the listing found
(`problem`: a tar cut short, a row without media), which makes every record of the item a final
`bad_input` error naming it, however its fetch went."""

from __future__ import annotations

import json
from collections.abc import Iterable

from tasks.sources.items import WorkItem

BAD_INPUT = "bad_input"


def annotate_records(items: Iterable[WorkItem], records: list) -> list:
    """`records` (ResultRecord) with their items' metadata and listing problems."""
    by_id = {item.id: item for item in items if item.metadata or item.problem}
    if not by_id:
        return records
    annotated = []
    for record in records:
        item = by_id.get(record.key)
        if item is not None:
            update = {}
            if item.metadata:
                update["metadata"] = json.loads(item.metadata)
            if item.problem:
                update.update(error={"kind": BAD_INPUT, "message": item.problem, "retryable": False},
                              text=None, finish_reason=None, structured=None)
            record = record.model_copy(update=update)
        annotated.append(record)
    return annotated
