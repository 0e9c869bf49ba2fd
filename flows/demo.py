"""`vlm-caption demo`: the whole flow on a handful of generated images, offline. Without --model it
builds a tiny random-weight LLaVA checkpoint, so it runs on any laptop's CPU with the `cpu` extra (its
captions are noise); with --model (a local path or a hub id) and a GPU it is a real captioning run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlm_caption.flows.params import CaptionJob

BANNER = "!" * 78


def make_sample_images(folder: Path, count: int) -> list[Path]:
    """Simple scenes (sky, sun, shapes, text) in several formats and sizes. One already there is
    kept, so that a second demo finds nothing new (a file written again would be a new item)."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    palette = [(220, 60, 60), (60, 160, 80), (60, 90, 200), (240, 200, 40), (150, 80, 190)]
    paths = []
    for i in range(count):
        path = folder / f"sample-{i:02d}{('.jpg', '.png', '.webp')[i % 3]}"
        paths.append(path)
        if path.exists():
            continue
        width, height = 320 + 40 * (i % 3), 240 + 30 * (i % 2)
        image = Image.new("RGB", (width, height), (135, 190, 235))
        draw = ImageDraw.Draw(image)
        draw.rectangle([0, height * 2 // 3, width, height], fill=(70, 150, 70))
        draw.ellipse([width - 80, 20, width - 30, 70], fill=(250, 220, 60))
        color = palette[i % len(palette)]
        x = 30 + 25 * i % (width - 120)
        if i % 3 == 0:
            draw.rectangle([x, 90, x + 80, 170], fill=color)
        elif i % 3 == 1:
            draw.ellipse([x, 90, x + 80, 170], fill=color)
        else:
            draw.polygon([(x, 170), (x + 40, 90), (x + 80, 170)], fill=color)
        draw.text((10, 10), f"sample {i}", fill=(0, 0, 0))
        image.save(path)
    return paths


def demo_job(args, job_fields: dict[str, Any]) -> CaptionJob:
    """The demo's job: its images made, and without --model the tiny checkpoint built. `run`'s own
    path runs it (flows/cli.py): the engine starts first, beside Prefect's start."""
    from vlm_caption.flows.params import CaptionJob
    from vlm_caption.tasks.errors import UsageError

    root = Path(args.dir).resolve()
    if job_fields.get("modality", "image") != "image":
        raise UsageError("the demo makes images; run videos or groups with `vlm-caption run`")
    if not job_fields.get("model") and job_fields.get("recipe", "llava") != "llava":
        raise UsageError("--model is required with a recipe other than llava")
    make_sample_images(root / "images", args.images)
    if not job_fields.get("model"):
        from vlm_caption.tasks.tiny_checkpoint import build_tiny_llava

        print(BANNER)
        print("NO --model GIVEN: building a tiny RANDOM-WEIGHT LLaVA checkpoint.")
        print("Everything real runs (vLLM, the processor, Prefect, storage), but the")
        print("CAPTIONS ARE NOISE. Pass --model llava-hf/llava-1.5-7b-hf on a GPU for real ones.")
        print(BANNER)
        job_fields["model"] = str(build_tiny_llava(root / "tiny-llava"))
        job_fields.setdefault("sampling", {}).setdefault("max_tokens", 24)
    job_fields.setdefault("shard_size", 4)
    # The output: its parquet/, manifests/, logs/.
    return CaptionJob(source=str(root / "images"), output=str(root / "captions"), **job_fields)


def print_samples(summary: dict[str, Any], output: str) -> None:
    """The first captions of the job, under the run's summary: from the newest file of the
    Parquet view that holds any (this run's, or an earlier run's when nothing was new)."""
    from vlm_caption.tasks.results.done_rows import view_files
    from vlm_caption.tasks.results.layout import PARQUET_VIEW_PREFIX
    from vlm_caption.tasks.results.parquet import read_records
    from vlm_caption.tasks.sources.storage import open_storage

    out = open_storage(output)
    for ref in reversed(view_files(out.iter_objects(prefix=PARQUET_VIEW_PREFIX))):
        records = [record for record in read_records(out, ref.key) if record.fingerprint == summary["fingerprint"]]
        for record in records[:3]:
            print(f"  {record.key}: {(record.text or record.error)!r}")
        if records:
            return
