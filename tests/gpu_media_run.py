"""Video and multi-image through the flow on a GPU host, with tiny random-weight checkpoints:
64 clips (qwen2_vl, 16 frames) and 64 three-image groups (idefics3, generate and chat), two
questions each. Not a test: run by hand, `python -m tests.gpu_media_run`; it prints one summary
line per case and writes them to $OUT/media.json (or /tmp)."""

import json
import os
import time
from pathlib import Path


def main():
    from vlm_caption.flows.caption import vlm_caption
    from vlm_caption.flows.params import CaptionJob
    from tests.checkpoints import build_checkpoint
    from tests.images import image_bytes, video_bytes

    root = Path("/tmp/gpu-media"); root.mkdir(exist_ok=True)
    clips = root / "clips"; clips.mkdir(exist_ok=True)
    for i in range(64):
        (clips / f"clip{i:03d}.mp4").write_bytes(video_bytes(frames=48, fps=8, size=(320, 240), seed=i))
    albums = root / "albums"
    for g in range(64):
        (albums / f"g{g:03d}").mkdir(parents=True, exist_ok=True)
        for j in range(3):
            (albums / f"g{g:03d}" / f"{j}.jpg").write_bytes(image_bytes(size=(640, 480), color=(g * 3 % 255, j * 80, 100)))
    out = {}
    for name, recipe, arch, source, extra in [
        ("video", "qwen2_vl", "qwen2_vl", clips, {"modality": "video", "num_frames": 16}),
        ("multi-image", "idefics3", "idefics3", albums, {"modality": "multi-image", "max_images": 3}),
        ("multi-image-chat", "idefics3", "idefics3", albums, {"modality": "multi-image", "max_images": 3, "method": "chat"}),
    ]:
        model = build_checkpoint(arch, root / "ckpt")
        t = time.time()
        summary = vlm_caption(CaptionJob(source=str(source), output=str(root / f"out-{name}"), recipe=recipe,
                                         model=str(model), shard_size=16, sampling={"max_tokens": 32, "ignore_eos": True},
                                         questions=["Describe it.", "What colours?"], **extra))
        summary["total_s"] = round(time.time() - t, 1)
        out[name] = {k: v for k, v in summary.items() if k != "failures"}
        print("GPU-MEDIA", name, json.dumps(out[name]), flush=True)
    Path(os.environ.get("OUT", "/tmp")).joinpath("media.json").write_text(json.dumps(out, indent=2))

if __name__ == "__main__":
    main()
