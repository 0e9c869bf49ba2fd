"""The run's gallery in Prefect's UI (the `vlm-caption-gallery` artifact). The page itself is a
file next to the manifest, and the UI can link to neither a `file://` path (a browser does not
open one from an http page) nor an `s3://` URI, so the artifact is what opens from the UI:

- the page's items as a table (key, question, caption or error), the page's location (with its
  pictures) in the description;
- an S3 output whose operator asked for it (VLM_CAPTION_GALLERY_LINK_S): a presigned HTTPS link
  to the page (GET only, that one object), with its expiry. Off by default, because the link holds
  the signing credentials' access key id (and session token) in the clear.
"""

from __future__ import annotations

import time
from vlm_caption.tasks.results.gallery_page import GalleryItem, cut
from vlm_caption.tasks.settings import get_settings
from vlm_caption.tasks.sources.storage import S3Storage, Storage

CELL_CHARS = 500  # a table cell's text; the page has the whole


def gallery_link(out: S3Storage, key: str, expires_s: int) -> str:
    """A presigned GET of the page, served as HTML. Signed with temporary credentials (an instance
    role, SSO), it ends when they do, which may be sooner than `expires_s`."""
    from vlm_caption.tasks.sources.s3_client import shared_s3_client

    return shared_s3_client().generate_presigned_url(
        "get_object", ExpiresIn=expires_s,
        Params={"Bucket": out.bucket, "Key": out.prefix + key, "ResponseContentType": "text/html"})


def gallery_rows(items: list[GalleryItem]) -> list[dict[str, str]]:
    """One row per (item, question): what the page shows, as text."""
    rows = []
    for item in items:
        for record in item.records:
            if record.error:
                answer = f"error: {record.error.get('kind', 'error')}: {record.error.get('message', '')}"
            else:
                answer = record.text or ""
            rows.append({"key": item.key, "question": record.question or "",
                         "caption": cut(answer, CELL_CHARS, " on the page")})
    return rows


def publish_gallery(out: Storage, key: str, items: list[GalleryItem]) -> dict:
    """The artifact for the page at `key` of `out`; what it says, for the manifest ({} outside a
    flow run)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return {}
    path = out.describe(key)
    description = f"The run's gallery: a sample of {len(items)} items"
    link_s = get_settings().gallery_link_s
    if isinstance(out, S3Storage) and link_s > 0:
        link = gallery_link(out, key, link_s)
        until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(time.time() + link_s))
        create_markdown_artifact(
            key="vlm-caption-gallery", description=description,
            markdown=f"**[Open the gallery]({link})** ({len(items)} items, thumbnails and captions): a "
                     f"presigned link, valid until {until} (or until the credentials that signed it expire).\n\n"
                     f"The page: `{path}`")
        return {"link_expires": until}
    create_table_artifact(key="vlm-caption-gallery", table=gallery_rows(items),
                          description=f"{description}. The page with its pictures: `{path}`")
    return {}
