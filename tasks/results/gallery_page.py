"""The gallery's page: its items and their HTML, self-contained, errors in red; a caption longer
than PREVIEW_CHARS shows its start, the rest (up to TEXT_CHARS) a click away. The run's
`vlm-caption-gallery` artifact (`publish_gallery`) is the items as a table, or a presigned link
(docs/operations.md says why, and why it is off by default)."""

from __future__ import annotations

import html
import json
import time
from dataclasses import dataclass, field

from vlm_caption.tasks.records import ResultRecord
from vlm_caption.tasks.settings import get_settings
from vlm_caption.tasks.sources.storage import S3Storage, Storage

PREVIEW_CHARS = 280
TEXT_CHARS = 4000
CELL_CHARS = 500  # an artifact table cell's text; the page has the whole


@dataclass
class GalleryItem:
    """One item of the page: its records (one per question) in question order."""

    key: str
    records: list[ResultRecord] = field(default_factory=list)
    thumbnail: str | None = None  # a data: URI
    strip: list[str] = field(default_factory=list)  # a video's frames, data: URIs

    @property
    def failed(self) -> bool:
        return any(r.error for r in self.records)

    @property
    def flagged(self) -> bool:  # a caption flagged by the caption checks (tasks/results/quality.py)
        return any(r.quality for r in self.records)


def cut(text: str, limit: int = TEXT_CHARS, where: str = "") -> str:
    return text if len(text) <= limit else text[:limit] + f"… ({len(text) - limit} more characters{where})"


def _json(value) -> str:
    return cut(json.dumps(value, ensure_ascii=False, indent=1, default=str))


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
h1{font-size:20px;margin:0 0 4px} .meta{color:#666;margin-bottom:12px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(320px,1fr));gap:12px}
.item{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px;overflow:hidden}
.item.failed{border:2px solid #d33;background:#fff4f4}
.strip{display:flex;gap:2px;margin-bottom:6px} .strip img{width:72px;height:54px;object-fit:contain;background:#eee}
.thumb{width:160px;height:120px;object-fit:contain;background:#eee;display:block;margin-bottom:6px}
.placeholder{width:160px;height:120px;background:#ddd;display:flex;align-items:center;justify-content:center;
 color:#555;font-size:12px;margin-bottom:6px;text-align:center}
.key{font-family:monospace;font-size:12px;word-break:break-all} .q{color:#555;font-style:italic;margin-top:6px}
.caption,.error,.q{white-space:pre-wrap;overflow-wrap:anywhere} .error{color:#b00;font-weight:600}
details.caption summary{cursor:pointer;list-style:none} details.caption summary::-webkit-details-marker{display:none}
details.caption[open] .preview{display:none} .more{color:#36c;font-size:12px;white-space:nowrap}
.label{color:#888;font-size:11px;margin-top:6px} pre{margin:2px 0;background:#f3f3f3;padding:4px;font-size:11px;white-space:pre-wrap;max-height:160px;overflow:auto}
"""


def _item_html(item: GalleryItem) -> str:
    first = item.records[0]
    if item.strip:
        frames = "".join(f'<img src="{uri}" alt="frame {i + 1} of {len(item.strip)}">'
                         for i, uri in enumerate(item.strip))
        count = f" · {first.video.get('frames')} frames" if first.video and first.video.get("frames") else ""
        picture = (f'<div class="strip" data-frames="{len(item.strip)}">{frames}</div>'
                   f'<div class="label">video{html.escape(count)}</div>')
    elif item.thumbnail:
        picture = f'<img class="thumb" src="{item.thumbnail}" alt="{html.escape(item.key)}">'
    else:
        label = "video" if first.video else ("no preview" if item.failed else "image")
        frames = f"<br>{first.video.get('frames')} frames" if first.video else ""
        picture = f'<div class="placeholder">{label}{frames}</div>'
    parts = [f'<div class="item{" failed" if item.failed else ""}" data-key="{html.escape(item.key)}">', picture,
             f'<div class="key">{html.escape(item.key)}</div>']
    for record in item.records:
        parts.append(f'<div class="q">{html.escape(cut(record.question or "", 300))}</div>')
        if record.error:
            kind, message = record.error.get("kind", "error"), record.error.get("message", "")
            parts.append(f'<div class="error">error: {html.escape(kind)}: {html.escape(cut(message, 600))}</div>')
        if record.quality:
            parts.append(f'<div class="error quality">flagged: {html.escape(", ".join(record.quality))}</div>')
        if record.duplicate_of:  # the same bytes as that item: its answer, no request of its own
            parts.append(f'<div class="label copy">copy of {html.escape(record.duplicate_of)}</div>')
        if record.text and len(record.text) <= PREVIEW_CHARS:
            parts.append(f'<div class="caption">{html.escape(record.text)}</div>')
        elif record.text:  # its start, and all of it on a click
            parts.append(f'<details class="caption"><summary><span class="preview">'
                         f'{html.escape(record.text[:PREVIEW_CHARS])}… </span><span class="more">show all '
                         f'{len(record.text)} characters</span></summary>{html.escape(cut(record.text))}</details>')
        if record.structured is not None:
            parts.append(f'<div class="label">structured</div><pre class="structured">'
                         f'{html.escape(_json(record.structured))}</pre>')
    if first.metadata:
        parts.append(f'<div class="label">metadata</div><pre class="metadata">{html.escape(_json(first.metadata))}</pre>')
    parts.append("</div>")
    return "".join(parts)


def render_gallery(items: list[GalleryItem], title: str, summary: dict) -> str:
    """The page: a title, a line of counts (with the copies among the items shown), the items (failed ones first)."""
    copies = sum(1 for item in items if item.records and all(r.duplicate_of for r in item.records))
    summary = {**summary, "copies": copies} if copies else summary
    line = " · ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in summary.items())
    body = "\n".join(_item_html(item) for item in items)
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f'<div class="meta">{line} · shown: {len(items)}</div><div class="grid">\n{body}\n</div></body></html>')


def publish_gallery(out: Storage, key: str, items: list[GalleryItem]) -> dict:
    """The artifact for the page at `key` of `out`; what it says, for the manifest ({} outside a flow run)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return {}
    path = out.describe(key)
    description = f"The run's gallery: a sample of {len(items)} items"
    link_s = get_settings().gallery_link_s
    if isinstance(out, S3Storage) and link_s > 0:
        from vlm_caption.tasks.sources.s3_client import shared_s3_client

        # A presigned GET of the page, served as HTML. Signed with temporary credentials (an
        # instance role, SSO), it ends when they do, which may be sooner than `link_s`.
        link = shared_s3_client().generate_presigned_url(
            "get_object", ExpiresIn=link_s,
            Params={"Bucket": out.bucket, "Key": out.prefix + key, "ResponseContentType": "text/html"})
        until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(time.time() + link_s))
        create_markdown_artifact(
            key="vlm-caption-gallery", description=description,
            markdown=f"**[Open the gallery]({link})** ({len(items)} items, thumbnails and captions): a "
                     f"presigned link, valid until {until} (or until the credentials that signed it expire).\n\n"
                     f"The page: `{path}`")
        return {"link_expires": until}
    # One row per (item, question): what the page shows, as text.
    rows = [{"key": item.key, "question": record.question or "",
             "caption": cut(f"error: {record.error.get('kind', 'error')}: {record.error.get('message', '')}"
                            if record.error else record.text or "", CELL_CHARS, " on the page")}
            for item in items for record in item.records]
    create_table_artifact(key="vlm-caption-gallery", table=rows,
                          description=f"{description}. The page with its pictures: `{path}`")
    return {}
