"""What an item brings besides its media, put into its records: a WebDataset sample's
`.json`/`.txt` or a Parquet row's other columns (`metadata`). Damage the listing found is not
patched in here: the reader's `read` raises it (`BadInput`) and prepare records it."""

from __future__ import annotations

import json
from collections.abc import Iterable

from vlm_caption.tasks.sources.items import WorkItem


def annotate_records(items: Iterable[WorkItem], records: list) -> list:
    """`records` (ResultRecord) with their items' metadata."""
    by_id = {item.id: item for item in items if item.metadata}
    if not by_id:
        return records
    return [record.model_copy(update={"metadata": json.loads(by_id[record.key].metadata)})
            if record.key in by_id else record for record in records]
