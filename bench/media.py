"""The bench's media: N distinct photo-like JPEGs, MP4 clips, or folders of GROUP_SIZE JPEGs,
made once per working folder and listed the way the flow lists them."""

from __future__ import annotations

from pathlib import Path

from vlm_caption.bench.config import BenchConfig

GROUP_SIZE = 2


def make_bench_images(folder: Path, count: int, width: int, height: int) -> Path:
    """`count` distinct photo-like JPEGs (noise over gradients: no two decode alike), made on
    every core: 1024 at 1920x1080 take minutes in one process, and on a GPU host that is lent time."""
    from concurrent.futures import ProcessPoolExecutor

    from vlm_caption.tasks.media.pool import usable_cores

    folder.mkdir(parents=True, exist_ok=True)
    missing = [i for i in range(count) if not (folder / f"img-{i:06d}.jpg").exists()]
    with ProcessPoolExecutor(max_workers=min(len(missing), usable_cores()) or 1) as pool:
        list(pool.map(_make_image, [(folder, i, width, height) for i in missing], chunksize=8))
    return folder


def _make_image(args: tuple[Path, int, int, int]) -> None:
    import numpy as np
    from PIL import Image

    folder, i, width, height = args
    rng = np.random.default_rng(i)
    ramp = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    noise = rng.normal(0, 40, (height, width, 3)).astype(np.float32)
    pixels = np.clip(ramp * ((i % 7) + 1) / 7 + noise + (i * 37 % 255), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(folder / f"img-{i:06d}.jpg", quality=90)


def make_bench_videos(folder: Path, count: int, width: int, height: int, frames: int) -> Path:
    """`count` distinct MP4 clips (up to 65,536) of `frames * 2` frames at 8 fps (MPEG-4 part 2:
    every OpenCV build writes it)."""
    import cv2
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    first, copy = folder / "clip-000000.mp4", folder / "clip-000256.mp4"
    if first.exists() and copy.exists() and first.read_bytes() == copy.read_bytes():
        for old in folder.glob("clip-*.mp4"):  # made by a bench before _stamp_high_bits: clip 256 on repeat
            if int(old.stem.removeprefix("clip-")) >= 256:
                old.unlink()
    ramp = np.arange(width, dtype=np.int64)[None, :]
    for i in range(count):
        path = folder / f"clip-{i:06d}.mp4"
        if path.exists():
            continue
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 8, (width, height))
        for t in range(frames * 2):
            frame = np.zeros((height, width, 3), np.uint8)
            frame[:, :, 0] = (ramp * 3 + t * 9 + i * 37) % 256
            frame[:, :, 2] = (i * 53 + t * 5) % 256
            _stamp_high_bits(frame, i)
            writer.write(frame)
        writer.release()
    return folder


def _stamp_high_bits(frame, i: int) -> None:
    """The colours above repeat every 256 clips, and the flow captions identical bytes once: clip
    i + 256 would be clip i's copy. Bits 8-15 of i go in as solid green blocks along the top, large
    enough to survive the codec; clips 0-255 stay as they were."""
    height, width = frame.shape[:2]
    block_w, block_h = max(width // 8, 1), max(height // 8, 1)
    for bit in range(8):
        if (i >> (8 + bit)) & 1:
            frame[:block_h, bit * block_w:(bit + 1) * block_w, 1] = 255


def make_bench_media(cfg: BenchConfig, work: Path) -> Path:
    """Images, clips or groups (one folder of GROUP_SIZE images each) for `cfg`."""
    folder = work / f"{cfg.modality}-{cfg.width}x{cfg.height}-{cfg.images}"
    if cfg.modality == "video":
        return make_bench_videos(folder, cfg.images, cfg.width, cfg.height, cfg.frames)
    if cfg.modality == "image" and cfg.copies:
        return make_bench_copies(work / f"{folder.name}-copies-{cfg.copies:g}", cfg)
    if cfg.modality == "image":
        return make_bench_images(folder, cfg.images, cfg.width, cfg.height)
    flat = make_bench_images(work / f"images-{cfg.width}x{cfg.height}-{cfg.images * GROUP_SIZE}",
                             cfg.images * GROUP_SIZE, cfg.width, cfg.height)
    for i, path in enumerate(sorted(flat.glob("*.jpg"))):
        group = folder / f"group-{i // GROUP_SIZE:06d}"
        group.mkdir(parents=True, exist_ok=True)
        if not (group / path.name).exists():
            (group / path.name).symlink_to(path)
    return folder


def make_bench_copies(folder: Path, cfg: BenchConfig) -> Path:
    """`cfg.images` JPEGs of which `cfg.copies` (a fraction) are byte copies of the distinct ones,
    spread through the listing (every copy sorts among the distinct images, not after them)."""
    import shutil

    copies = round(cfg.images * cfg.copies)
    distinct = make_bench_images(folder.with_name(folder.name + "-distinct"), cfg.images - copies,
                                 cfg.width, cfg.height)
    originals = sorted(distinct.glob("*.jpg"))
    folder.mkdir(parents=True, exist_ok=True)
    stride = cfg.images / max(copies, 1)
    copy_slots = {int(k * stride) for k in range(copies)}
    taken = iter(originals)
    for i in range(cfg.images):
        target = folder / f"img-{i:06d}.jpg"
        if target.exists():
            continue
        source = originals[(i * 7919) % len(originals)] if i in copy_slots else next(taken)
        shutil.copyfile(source, target)
    return folder


def bench_items(cfg: BenchConfig, folder: Path) -> list[list[Path]]:
    """The bench's items, as the flow lists them: one file each, or one folder's files."""
    if cfg.modality == "multi-image":
        return [sorted(group.glob("*.jpg")) for group in sorted(folder.iterdir()) if group.is_dir()]
    return [[path] for path in sorted(folder.glob("*.mp4" if cfg.modality == "video" else "*.jpg"))]


TAR_SAMPLES = 1000  # samples per tar, as img2dataset writes them (10,000 there; fewer here, for small runs)


def make_bench_tars(folder: Path, work: Path) -> Path:
    """The same JPEGs packed as WebDataset shards (`NNNNN.tar` of `key.jpg` members): what the
    flow reads with `--source webdataset`; raw reads the JPEGs themselves, as it would unpacked."""
    import tarfile

    images = sorted(folder.glob("*.jpg"))
    shards = work / f"{folder.name}-tars"
    shards.mkdir(parents=True, exist_ok=True)
    for index, start in enumerate(range(0, len(images), TAR_SAMPLES)):
        path = shards / f"{index:05d}.tar"
        if path.exists():
            continue
        partial = path.with_suffix(".tar.partial")
        with tarfile.open(partial, "w") as tar:
            for image in images[start:start + TAR_SAMPLES]:
                tar.add(image, arcname=f"{image.stem}.jpg")
        partial.rename(path)
    return shards

