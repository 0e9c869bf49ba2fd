"""Where the model's HF processor runs: on the GPU where it can, on the CPU otherwise.

vLLM runs the processor (resize, normalise, patchify every image and frame) in the process that
owns the `LLM`, one request at a time: for Qwen2-VL-style models on a GPU host the bottleneck (a
2B model kept an H100 62% busy on video with it on the CPU). transformers' fast (torch)
processors take `device`, which vLLM passes through from `mm_processor_kwargs`. Its GPU memory
lives in this (front-end) process, outside vLLM's memory profile: `mm_ipc_gpu_memory_gb`, vLLM's
own carve-out for front-end GPU work, takes it off the KV cache, so it never pushes the engine
into an out-of-memory error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from vlm_caption.recipes import Recipe, RecipeError

PROCESSOR_DEVICES: tuple[str, ...] = ("auto", "cuda", "cpu")
# GiB taken off the KV cache for the processor on the GPU: its CUDA context (about 0.5 GiB) plus
# the largest request's working memory, which the decode pool bounds by shrinking frames and
# images to the processor's own size first (measured: see docs/benchmarks.md).
PROCESSOR_GPU_GIB = 2.0


@dataclass(frozen=True)
class ProcessorPlacement:
    device: Literal["cuda", "cpu"]
    reason: str

    def manifest(self) -> dict[str, str]:
        return {"processor_device": self.device, "processor_device_reason": self.reason}


def place_processor(recipe: Recipe, requested: str, *, gpu: bool,
                    user_kwargs: dict[str, Any] | None = None) -> ProcessorPlacement:
    """Pick the processor's device. `user_kwargs`: `mm_processor_kwargs` from the job's
    engine overrides, whose own `device` wins over everything."""
    if requested not in PROCESSOR_DEVICES:
        raise RecipeError(f"processor device {requested!r}: use one of {', '.join(PROCESSOR_DEVICES)}")
    if user_kwargs and "device" in user_kwargs:
        device = "cpu" if str(user_kwargs["device"]) == "cpu" else "cuda"
        return ProcessorPlacement(device, "set by the engine argument mm_processor_kwargs")
    if requested == "cpu":
        return ProcessorPlacement("cpu", "asked for (processor_device=cpu)")
    if not gpu:
        if requested == "cuda":
            raise RecipeError("processor_device=cuda needs an NVIDIA GPU, and vLLM runs on the CPU here; "
                              "use processor_device=auto (or cpu)")
        return ProcessorPlacement("cpu", "no GPU on this machine")
    if recipe.needs_remote_code:
        return ProcessorPlacement("cpu", f"the processor of recipe {recipe.name!r} is the model repository's own code")
    if requested == "cuda":
        return ProcessorPlacement("cuda", "asked for (processor_device=cuda)")
    if not recipe.processor_on_gpu:
        return ProcessorPlacement("cpu", f"the processor of recipe {recipe.name!r} is not checked on the GPU "
                                         "(processor_device=cuda tries it)")
    return ProcessorPlacement("cuda", f"recipe {recipe.name!r} has a fast (torch) processor and a GPU is present")


def apply_placement(args: dict[str, Any], placement: ProcessorPlacement) -> None:
    """Write the placement into vLLM's engine arguments (a caller's own values stay)."""
    if placement.device != "cuda":
        return
    kwargs = dict(args.get("mm_processor_kwargs") or {})
    kwargs.setdefault("device", "cuda")
    args["mm_processor_kwargs"] = kwargs
    args.setdefault("mm_ipc_gpu_memory_gb", PROCESSOR_GPU_GIB)
    # vLLM takes the processor's share off a fixed `kv_cache_memory_bytes`, and fails its start
    # deep in the engine process when nothing is left; say so before any engine starts.
    fixed, carve_out = args.get("kv_cache_memory_bytes"), float(args["mm_ipc_gpu_memory_gb"])
    if fixed is not None and fixed <= carve_out * 1024**3:
        raise RecipeError(
            f"kv_cache_memory_bytes={fixed} ({fixed / 1024**3:.2f} GiB) leaves no KV cache once the model's "
            f"processor takes its {carve_out:g} GiB on the GPU (mm_ipc_gpu_memory_gb): give more than "
            f"{carve_out:g} GiB, or run the processor on the CPU (--processor-device cpu)")
