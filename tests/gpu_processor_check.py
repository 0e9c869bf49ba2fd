"""By hand, on a GPU: the model processor on the GPU gives what it gives on the CPU.

    python -m tests.gpu_processor_check [--out gpu-processor-check.json]

For every recipe that puts its processor on the GPU (`processor_on_gpu`), on a tiny random-weight
checkpoint of its architecture with the recipe's own pixel limits:
- processed inputs: vLLM's multimodal processor (no engine) with `device` cpu and cuda, on a
  1920x1080 photo, a pair of 1280x720 photos, 16 frames at 640x480 and 16 frames at 3840x2160:
  prompt token ids and grids equal, pixel values within PIXEL_TOLERANCE (normalised units; one
  step of 8-bit colour is about 0.015), and the GPU memory the processor held at its peak;
  and the same on the GPU once the media are resized as the flow resizes them (on the CPU, with
  the processor's own resize: `tasks/media/resize.py`), where the pixel values must be equal;
- tokens: the same greedy requests through a real vLLM engine, the processor on the CPU against
  the flow's way (media resized on the CPU, the processor on the GPU): the same output tokens.
  (Without the CPU resize, the GPU's bicubic kernel differs by a few 8-bit steps, and a
  random-weight model's greedy tokens then differ on some requests: measured 1 and 3 of 16.)
Writes JSON and exits 1 on any mismatch. CPU CI covers the choice and the plumbing
(tests/test_processor_device.py); this covers the numbers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.vllm_processing import process, tensors

PIXEL_TOLERANCE = 0.05  # max |cpu - gpu| over every pixel value: a few 8-bit steps after resampling
ITEMS_FOR_TOKENS = 8
PROMPTS = {"image": "<|vision_start|><|image_pad|><|vision_end|>Describe.",
           "multi-image": "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>Describe.",
           "video": "<|vision_start|><|video_pad|><|vision_end|>Describe."}


def cases():
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)

    def photo(width, height):  # smooth content plus noise: resampling differences show in both
        y, x = np.mgrid[0:height, 0:width]
        base = np.stack([(x * 255 // width), (y * 255 // height), ((x + y) * 127 // (width + height))], -1)
        return (base + rng.integers(0, 40, (height, width, 3))).clip(0, 255).astype(np.uint8)

    return {"photo 1920x1080": ("image", {"image": Image.fromarray(photo(1920, 1080))}),
            "pair 1280x720": ("multi-image", {"image": [Image.fromarray(photo(1280, 720)) for _ in range(2)]}),
            "video 16x640x480": ("video", {"video": np.stack([photo(640, 480) for _ in range(16)])}),
            "video 16x3840x2160": ("video", {"video": np.stack([photo(3840, 2160) for _ in range(16)])})}


def processing_check(recipe_name: str, model: str) -> list[dict]:
    import torch

    from vlm_caption.recipes import get_recipe

    recipe = get_recipe(recipe_name)
    rows = []
    for case, (modality, media) in cases().items():
        kwargs = dict(recipe.engine_args_for(modality, model=model).get("mm_processor_kwargs") or {})
        cpu_started = time.perf_counter()
        on_cpu = process(model, PROMPTS[modality], media, {**kwargs, "device": "cpu"})
        cpu_s = time.perf_counter() - cpu_started
        process(model, PROMPTS[modality], media, {**kwargs, "device": "cuda"})  # warm-up (kernels, context)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu_started = time.perf_counter()
        on_gpu = process(model, PROMPTS[modality], media, {**kwargs, "device": "cuda"})
        torch.cuda.synchronize()
        gpu_s = time.perf_counter() - gpu_started
        peak_mb = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        as_flow = process(model, PROMPTS[modality], flow_resized(model, modality, media, kwargs),
                          {**kwargs, "device": "cuda"})
        diffs, exact = compare(on_cpu, on_gpu)
        flow_diffs, flow_exact = compare(on_cpu, as_flow)
        ok = (on_cpu["prompt_token_ids"] == on_gpu["prompt_token_ids"] == as_flow["prompt_token_ids"]
              and all(exact.values()) and all(flow_exact.values())
              and all(d <= PIXEL_TOLERANCE for d in diffs.values()) and not any(flow_diffs.values()))
        rows.append({"recipe": recipe_name, "case": case, "ok": ok, "prompt_tokens": len(on_cpu["prompt_token_ids"]),
                     "max_abs_diff": diffs, "max_abs_diff_as_flow": flow_diffs, "exact": exact,
                     "cpu_s": round(cpu_s, 3), "gpu_s": round(gpu_s, 3), "gpu_peak_mb": peak_mb})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def compare(a_processed, b_processed):
    """The largest difference of each float tensor, and whether each other tensor is equal."""
    import torch

    a, b = tensors(a_processed), tensors(b_processed)
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    diffs = {k: float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point()}
    return diffs, {k: bool(torch.equal(a[k], b[k])) for k in a if not a[k].is_floating_point()}


def flow_resized(model: str, modality: str, media: dict, kwargs: dict) -> dict:
    """The media as the flow hands them to vLLM: resized on the CPU with the processor's own resize."""
    from vlm_caption.tasks.media.resize import processor_resize

    kind = "video" if modality == "video" else "image"
    resize = processor_resize(model, kwargs, kind)
    assert resize is not None, f"{model}: no processor resize for {kind}"
    value = media[kind]
    return {kind: [resize.apply(v) for v in value] if isinstance(value, list) else resize.apply(value)}


def tokens_on(recipe_name: str, model: str, device: str) -> list[list[int]]:
    """Greedy output tokens for ITEMS_FOR_TOKENS photos and clips: `cpu`, the processor on the CPU;
    `flow`, the media resized on the CPU as the flow does and the processor on the GPU."""
    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams

    from vlm_caption.recipes import get_recipe
    from vlm_caption.tasks.engine.arguments import EngineSpec, engine_plan

    rng = np.random.default_rng(1)
    spec = EngineSpec.build(get_recipe(recipe_name), modality="video", model=model,
                            processor_device="cuda" if device == "flow" else device)
    args, placement = engine_plan(spec, on_cpu=False)
    kwargs = {k: v for k, v in args["mm_processor_kwargs"].items() if k != "device"}
    # One engine for photos and clips (the video recipe's pixel limits apply to both). One request
    # at a time: in a batch, a request's numbers depend on which others share its steps, which
    # depends on when the front end (slower or faster with the processor moved) added them; a
    # random-weight model's near-tied logits then flip greedy tokens with identical inputs.
    llm = LLM(**{**args, "gpu_memory_utilization": 0.3, "enforce_eager": True, "max_num_seqs": 1,
                 "limit_mm_per_prompt": {"image": 1, "video": 1}})
    requests = [{"prompt": PROMPTS["image"], "multi_modal_data": {
                    "image": Image.fromarray(rng.integers(0, 255, (720, 1280, 3), dtype=np.uint8))}}
                for _ in range(ITEMS_FOR_TOKENS)]
    requests += [{"prompt": PROMPTS["video"], "multi_modal_data": {
                     "video": rng.integers(0, 255, (8, 480, 640, 3), dtype=np.uint8)}}
                 for _ in range(ITEMS_FOR_TOKENS)]
    if device == "flow":
        for request in requests:
            ((kind, value),) = request["multi_modal_data"].items()
            request["multi_modal_data"] = flow_resized(model, kind, {kind: value}, kwargs)
    done = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in done]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-processor-check.json")
    parser.add_argument("--recipes", nargs="*", help="only these recipes (default: every processor_on_gpu one)")
    parser.add_argument("--skip-processing", action="store_true", help="only the greedy-token comparison")
    parser.add_argument("--tokens", nargs=3, metavar=("RECIPE", "MODEL", "DEVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tokens:  # a child: one engine's tokens, printed
        print("TOKENS " + json.dumps(tokens_on(*args.tokens)), flush=True)
        return 0
    from vlm_caption.recipes import all_recipes
    from tests.checkpoints import build_checkpoint

    root = Path(tempfile.mkdtemp(prefix="gpu-processor-check-"))
    report = {"processing": [], "tokens": []}
    for recipe in (r for r in all_recipes() if r.processor_on_gpu and (not args.recipes or r.name in args.recipes)):
        model = str(build_checkpoint(recipe.name, root))
        if not args.skip_processing:
            report["processing"] += processing_check(recipe.name, model)
        tokens = {}
        for device in ("cpu", "flow"):  # each engine in a process of its own: GPU memory comes back
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "tests.gpu_processor_check", "--tokens", recipe.name,
                                   model, device], capture_output=True, text=True, timeout=240)
            print(f"{recipe.name} tokens with the processor on {device}: {time.perf_counter() - started:.0f} s, "
                  f"rc {done.returncode}", flush=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
            tokens[device] = json.loads(lines[-1][7:]) if lines else done.stderr[-2000:]
        same = ([a == b for a, b in zip(tokens["cpu"], tokens["flow"])]
                if isinstance(tokens["cpu"], list) and isinstance(tokens["flow"], list) else [])
        report["tokens"].append({"recipe": recipe.name, "requests": len(same), "same_tokens": sum(same),
                                 "ok": bool(same) and all(same),
                                 "error": None if same else str(tokens)[-2000:]})
        print(json.dumps(report["tokens"][-1]), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    Path(args.out).write_text(json.dumps(report, indent=2))
    ok = all(row["ok"] for rows in report.values() for row in rows)
    print(f"{'OK' if ok else 'MISMATCH'}: written {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
