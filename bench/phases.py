"""What runs inside one phase's process of `vlm-caption bench` (bench/driver.py starts
each as `python -m vlm_caption.bench.phases <phase> <config> <folder> <model>`, so the previous phase's
GPU memory is gone): raw vLLM as the examples run it (serial decode, then one `LLM.generate`; the
i-th of N processes over its 1/N of the items), or the flow (on one GPU, or fanned out). Each
writes its figures, as JSON, to the file VLM_CAPTION_BENCH_RESULT names."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from vlm_caption.bench.config import RESULT_FILE, WARM_UP_ITEMS, BenchConfig
from vlm_caption.bench.media import GROUP_SIZE, bench_items, make_bench_tars


def example_media(cfg: BenchConfig, paths: list[Path], needs_metadata: bool):
    """One item decoded as the examples do it, in the caller: PIL images, or sampled frames."""
    from PIL import Image

    if cfg.modality == "video":
        from vlm_caption.tasks.media.video import VideoLimits, decode_video

        video = decode_video(paths[0].read_bytes(), num_frames=cfg.frames,
                             limits=VideoLimits(max_seconds=1e9, max_frame_pixels=1 << 40))
        return video.for_request(needs_metadata)
    images = [Image.open(p).convert("RGB") for p in paths]
    return images if cfg.modality == "multi-image" else images[0]


def phase_raw(cfg: BenchConfig, folder: Path, model: str, processor_device: str = "cpu",
              part: tuple[int, int] | None = None) -> dict[str, Any]:
    """Raw vLLM the example's way over every item, or, with `part` (i, n), over the i-th of n
    contiguous slices of them (one process of raw, N processes)."""
    started = _process_started()  # vLLM's import counts, as it does in the flow's wall
    process_started_at = time.time() - (time.perf_counter() - started)
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    from vlm_caption.recipes import get_recipe
    from vlm_caption.recipes.base import MEDIA_KIND
    from vlm_caption.recipes.requests import prompt_text
    from vlm_caption.tasks.engine.arguments import EngineSpec, eager_engine_processes, engine_plan

    recipe = get_recipe(cfg.recipe)
    items = bench_items(cfg, folder)
    if part is not None:
        items = raw_slice(items, *part)
    count = GROUP_SIZE if cfg.modality == "multi-image" else 1
    spec = EngineSpec.build(recipe, modality=cfg.modality, model=model, images=count,
                            processor_device=processor_device)
    args, placement = engine_plan(spec, on_cpu=current_platform.is_cpu())
    eager_engine_processes(args, on_cpu=current_platform.is_cpu())  # as the flow's engine starts
    building = time.perf_counter()
    llm = LLM(**args)
    engine_s = time.perf_counter() - started
    build_s = time.perf_counter() - building
    engine_ready_at = time.time()
    kind = MEDIA_KIND[cfg.modality]
    prompt = prompt_text(recipe.prompting(cfg.modality), llm.get_tokenizer(),
                         f"Describe the content of this {kind} in detail.", count, kind)
    decode_started = time.perf_counter()
    inputs = [{"prompt": prompt, "multi_modal_data": {kind: example_media(cfg, paths, recipe.needs_video_metadata)}}
              for paths in items]
    decode_s = time.perf_counter() - decode_started
    generate_started = time.time()
    structured = {}
    if cfg.json_schema:  # the request the flow sends for the same schema (tasks/engine/vllm_engine.py)
        from vllm.sampling_params import StructuredOutputsParams

        structured = {"structured_outputs": StructuredOutputsParams(json=cfg.structured())}
    outputs = llm.generate(inputs, SamplingParams(temperature=0.0, **cfg.sampling(), **structured), use_tqdm=False)
    generate_s = time.time() - generate_started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids or []) for o in outputs)
    # engine_start_s: `vllm.LLM`'s own build, as the flow's; engine_ready_s: from the process's start
    return {"items": len(outputs), "engine_start_s": round(build_s, 2), "engine_ready_s": round(engine_s, 2),
            "decode_s": round(decode_s, 2), "output_tokens": tokens,
            # what vLLM's prefix cache served: items that repeat are encoded once (docs/benchmarks.md)
            "prompt_tokens": prompt_tokens, "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
            # generate returns everything at once: its end is the last (and the first) result
            "ready_to_last_items_per_s": len(outputs) / max(generate_started + generate_s - engine_ready_at, 1e-9),
            "generate_s": round(generate_s, 2), "generate_items_per_s": len(outputs) / generate_s,
            "items_per_s": len(outputs) / (time.perf_counter() - started - engine_s),
            "output_tokens_per_s": tokens / generate_s,
            "first_result_s": time.perf_counter() - started,  # generate returns everything at once
            "wall_s": time.perf_counter() - started, "processor_device": placement.device,
            "process_started_at": process_started_at, "engine_ready_at": engine_ready_at,
            "window": [generate_started, generate_started + generate_s]}


def raw_slice(items: list, index: int, count: int) -> list:
    """The index-th of `count` contiguous slices of `items`, their sizes at most one apart."""
    return items[index * len(items) // count:(index + 1) * len(items) // count]


def phase_flow(cfg: BenchConfig, folder: Path, model: str, fan_out: int = 1, limit: int | None = None) -> dict[str, Any]:
    started = _process_started()
    from vlm_caption.flows.cli import start_prefect
    from vlm_caption.flows.params import CaptionJob
    from vlm_caption.flows.plan import make_plan, start_engine_first

    source, output = str(folder), str(Path(cfg.workdir) / f"out-{int(time.time())}")
    if cfg.source == "s3":  # uploaded by the driver (bench/harness.py, s3_source)
        base = os.environ["VLM_CAPTION_BENCH_S3"].rstrip("/")
        source, output = f"{base}/images/", f"{base}/out-{int(time.time())}/"
    elif cfg.source == "webdataset":  # the same JPEGs in tar shards (made by run_bench)
        source = str(make_bench_tars(folder, Path(cfg.workdir).resolve()))
    job = CaptionJob(source=source, output=output, recipe=cfg.recipe, model=model, shard_size=cfg.shard_size,
                     modality=cfg.modality, num_frames=cfg.frames, max_images=GROUP_SIZE, follow_links=True,
                     sampling=cfg.sampling(), fan_out=fan_out, processor_device=cfg.processor_device,
                     json_schema=cfg.structured(), limit=limit,
                     engine_overrides=json.loads(cfg.engine_args) if cfg.engine_args else {})
    plan = make_plan(job)  # as `vlm-caption run` does: the plan, Prefect's import, vLLM's, the engine
    start_prefect()
    start_engine_first(plan)  # a fan-out's parent: its flow asks for its children first
    from vlm_caption.flows.caption import vlm_caption

    summary = vlm_caption(plan.job)
    from vlm_caption.tasks.sources.storage import open_storage, split_parent

    folder_uri, name = split_parent(summary["manifest"])
    manifest = json.loads(open_storage(folder_uri).read(name))
    engine, window = manifest.get("engine") or {}, manifest["generate_window"] or [0.0, 0.0]
    wall = time.perf_counter() - started
    # The engine starts in the background once the listing shows work; it was ready this long
    # after the process started (raw's engine_ready_s counts from the process start too). A
    # fan-out's first engine: the earliest of the run's own and its partitions' (each partition's
    # report in the manifest carries its `engine_ready_at` where the run wrote one).
    process_started_at = time.time() - (time.perf_counter() - started)
    briefs = manifest.get("partitions") or []
    first_ready_at, last_result_at = first_ready_last_result(engine, window, briefs)
    ready_s = first_ready_at - process_started_at if first_ready_at else None
    partitions = [_partition_figures(p, process_started_at) for p in briefs]
    # Every answer counts, as in raw (the flow's own figure counts successes: under --json-schema
    # a random-weight model's answers rarely parse, yet each was generated).
    generating = summary["processed"] / max(window[1] - window[0], 1e-9)
    return {"items": summary["processed"], "engine_start_s": round(engine.get("startup_s", 0.0), 2),
            "engine_ready_s": round(ready_s, 2) if ready_s is not None else None,
            # from the first engine ready to the last result, across partitions: what a fan-out
            # is put over raw, N processes on
            "ready_to_last_items_per_s": (summary["processed"] / max(last_result_at - first_ready_at, 1e-9)
                                          if first_ready_at and last_result_at else None),
            "generate_s": round(window[1] - window[0], 2), "generate_items_per_s": generating,
            # Each GPU's items/s while it generated, summed: what the GPUs sustain together, apart
            # from when each partition's run started (a worker's poll, its process, its engine).
            "summed_gpu_items_per_s": (sum(p["generate_items_per_s"] for p in partitions) if partitions
                                       else generating),
            "failed": summary["failed"],  # under --json-schema: answers that did not parse
            # answers taken from an item with the same bytes, no request: raw asks each file
            "copies": (manifest.get("counts") or {}).get("duplicates", 0),
            "items_per_s": summary["processed"] / max(wall - ready_s, 1e-9) if ready_s is not None else None,
            "output_tokens_per_s": summary["output_tokens_per_s"],
            "first_result_s": (summary["first_result_s"] or 0.0) + (wall - summary["wall_s"]),
            "wall_s": wall, "flow_wall_s": summary["wall_s"],
            "prefect_api": os.environ.get("PREFECT_API_URL") or "embedded",
            "processor_device": (engine.get("sizing") or {}).get("processor_device"),
            "partitions": partitions, "window": window}


def first_ready_last_result(engine: dict[str, Any], window: list[float],
                            briefs: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """A flow run's first engine ready and last result (unix times), from its manifest: the
    earliest of its own engine's `ready_at` and its partitions' `engine_ready_at` (where the
    manifest carries them), the latest of its generate window's end and its partitions'."""
    ready = [at for at in (engine.get("ready_at"), *(b.get("engine_ready_at") for b in briefs)) if at]
    ends = [at for at in (window[1], *(b.get("generate_to") for b in briefs)) if at]
    return min(ready, default=None), max(ends, default=None)


def _partition_figures(brief: dict[str, Any], process_started_at: float) -> dict[str, Any]:
    """One partition of a fanned-out run as the manifest lists it, its times from the parent's
    process start: when its engine was ready, when it generated."""
    since = lambda at: round(at - process_started_at, 2) if at else None  # noqa: E731
    ready_at, build_s = brief.get("engine_ready_at"), brief.get("engine_build_s")
    return {**{k: brief.get(k) for k in ("index", "worker", "devices", "processed", "generate_items_per_s")},
            # a partition's start: asked for, its process began (a worker's poll), vllm.LLM began, ready
            "asked_s": since(brief.get("asked_at")), "process_started_s": since(brief.get("process_started_at")),
            "engine_build_began_s": since(ready_at - build_s) if ready_at and build_s is not None else None,
            "engine_ready_s": since(ready_at),
            "generate_window_s": [since(brief.get("generate_from")), since(brief.get("generate_to"))]}


def _torch_gpu_peak_mb() -> float | None:
    """The most GPU memory torch held in this (front-end) process: the model processor's working
    memory when it runs on the GPU (its CUDA context comes on top); None where it never did."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    return round(torch.cuda.max_memory_reserved() / 2**20, 1)


def _process_started() -> float:
    """When this process started, on the `perf_counter` clock: both phases' walls include the
    interpreter's start and every import."""
    import psutil

    return time.perf_counter() - (time.time() - psutil.Process().create_time())


def child_main(phase: str, config_json: str, folder: str, model: str) -> None:
    cfg = BenchConfig(**json.loads(config_json))
    first_items = (0, max(1, cfg.images // WARM_UP_ITEMS))  # the slice that holds the first WARM_UP_ITEMS items
    if phase == "raw":
        result = phase_raw(cfg, Path(folder), model)
    elif phase.startswith("raw-n:"):  # "raw-n:i:n": the i-th process of raw, N processes
        _, index, count = phase.split(":")
        result = phase_raw(cfg, Path(folder), model, part=(int(index), int(count)))
    elif phase == "warm-up":  # the first WARM_UP_ITEMS items, as raw takes them
        result = phase_raw(cfg, Path(folder), model, part=first_items)
    elif phase in ("flow-warm-up", "start-flow"):  # the flow's own engine (its arguments are not raw's), a few items
        result = phase_flow(cfg, Path(folder), model, limit=WARM_UP_ITEMS)
    elif phase == "start-raw":  # a round of --start-rounds: raw with the flow's processor, the same few items
        result = phase_raw(cfg, Path(folder), model, processor_device=cfg.processor_device, part=first_items)
    elif phase == "raw-same":
        result = phase_raw(cfg, Path(folder), model, processor_device=cfg.processor_device)
    else:
        result = phase_flow(cfg, Path(folder), model, fan_out=cfg.gpus if phase == "fan-out" else 1)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["processor_gpu_peak_mb"] = _torch_gpu_peak_mb()
    # The driver reads the result from a file of its own: on stdout vLLM's processes write too, and a
    # line of theirs can run into this one ("(EngineCore pid=...) BENCH-RESULT ...", seen on CPU).
    Path(os.environ[RESULT_FILE]).write_text(json.dumps(result))
    print("BENCH-RESULT " + json.dumps(result), flush=True)  # for the phase's log


if __name__ == "__main__":
    child_main(*sys.argv[1:5])
