"""What the engine is built from: the `EngineSpec` the run's plan resolves once (the recipe, the
model's engine arguments with the caller's overrides), what the engine's host adds to it (sizing
for a CPU, where the model's processor runs), and the checks that refuse bad arguments before any
engine starts. No vLLM object is built here."""

from __future__ import annotations

import contextlib
import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any

from vlm_caption.recipes import Recipe, RecipeError
from vlm_caption.tasks.engine import vllm_api
from vlm_caption.tasks.engine.processor import ProcessorPlacement, apply_placement, place_processor

CPU_KV_CACHE_GIB = 2


@dataclass(frozen=True)
class EngineSpec:
    """The engine a run builds, resolved once by its plan (flows/plan.py) and handed down to the
    engine's tasks: the recipe object, the modality and the model's engine arguments (`args`: the
    recipe's for the modality and image count, remote code where the job allowed it, the job's
    overrides winning). Hashable (the key of the process's engine) and picklable (a Prefect task's
    parameter). What only the engine's host can tell, CPU or GPU, is added where the engine is
    built (`engine_plan`): vLLM's platform imports torch, which a run with nothing new never does."""

    recipe: Recipe = field(hash=False)  # compared, not hashed: its dicts cannot be
    modality: str = "image"
    model: str | None = None  # the job's model; None: the recipe's for the modality
    engine_overrides: tuple[tuple[str, str], ...] = ()  # (key, JSON value), hashable
    trust_remote_code: bool = False
    images: int = 1  # images per prompt for multi-image
    processor_device: str = "auto"  # where the model's HF processor should run (tasks/engine/processor.py)
    args: dict[str, Any] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_remote_code(self.recipe, self.trust_remote_code)
        args = self.recipe.engine_args_for(self.modality, images=self.images, model=self.model)
        if self.trust_remote_code and self.recipe.needs_remote_code:
            args["trust_remote_code"] = True
        args.update(self.overrides())
        object.__setattr__(self, "args", args)

    @classmethod
    def build(cls, recipe: Recipe, *, modality: str = "image", model: str | None = None,
              engine_overrides: dict[str, Any] | None = None, trust_remote_code: bool = False,
              images: int = 1, processor_device: str = "auto") -> EngineSpec:
        overrides = tuple(sorted((k, json.dumps(v)) for k, v in (engine_overrides or {}).items()))
        return cls(recipe, modality, model, overrides, trust_remote_code, images, processor_device)

    def overrides(self) -> dict[str, Any]:
        return {key: json.loads(value) for key, value in self.engine_overrides}


def check_remote_code(recipe: Recipe, allowed: bool) -> None:
    if recipe.needs_remote_code and not allowed:
        raise RecipeError(
            f"recipe {recipe.name!r} runs the model repository's own Python code "
            "(trust_remote_code). Review that code, then opt in with --trust-remote-code "
            "(flow parameter trust_remote_code=true)."
        )


def image_resize_target(spec: EngineSpec):
    """What the decode pool may shrink images to for this engine's model (None: leave them)."""
    from vlm_caption.tasks.media.resize import resize_target

    if spec.modality == "video":
        return None
    return resize_target(spec.args["model"], spec.args.get("mm_processor_kwargs"))


def frame_resize_target(spec: EngineSpec):
    """What the fetch threads may shrink video frames to: the size the model's video processor
    resizes them to anyway (None: leave them as decoded)."""
    from vlm_caption.tasks.media.resize import processor_resize

    if spec.modality != "video":
        return None
    return processor_resize(spec.args["model"], spec.args.get("mm_processor_kwargs"), "video")


def check_engine_overrides(overrides: dict[str, Any], *, import_vllm: bool = False) -> None:
    """Unknown vLLM engine arguments fail the job before anything starts, with close matches:
    checked against the fields recorded for the vLLM release pinned (tasks/engine/vllm_api.py),
    without importing vLLM. With another release installed the check waits for vLLM's import
    (`import_vllm`: `engine_plan`, before the engine is built)."""
    import difflib

    known = vllm_api.engine_argument_names(import_vllm=import_vllm) if overrides else None
    for key in overrides if known is not None else ():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise RecipeError(f"unknown vLLM engine argument {key!r}.{hint} "
                              "See `vllm serve --help` for the installed vLLM's engine arguments.")


def engine_plan(spec: EngineSpec, *, on_cpu: bool) -> tuple[dict[str, Any], ProcessorPlacement]:
    """The spec's engine arguments completed for this host (sizing for a CPU, the checkpoint's
    context limit), and where the model's processor runs, which they include. Called once, where
    the engine is built."""
    check_engine_overrides(spec.overrides(), import_vllm=True)  # with an unrecorded vLLM, here, not in the plan
    args = copy.deepcopy(spec.args)
    if on_cpu:
        args.setdefault("enforce_eager", True)  # compilation does not pay off for CPU-sized jobs
        # vLLM's start-up profile runs the vision encoder over its largest dummy batch to size
        # memory. On CPU the KV cache is sized in bytes (below) and nothing is compiled, so it
        # measures nothing.
        args.setdefault("skip_mm_profiling", True)
    placement = place_processor(spec.recipe, spec.processor_device, gpu=not on_cpu and _cuda_present(),
                                user_kwargs=spec.overrides().get("mm_processor_kwargs"))
    apply_placement(args, placement)
    # On CPU the KV cache gets a fixed size in bytes unless the caller sized it. vLLM's CPU worker
    # reads `gpu_memory_utilization` as a fraction of RAM *minus the engine process's own RSS at
    # start-up*: a small fraction fails at random ("Engine core initialization failed") whenever
    # the freshly loaded model's RSS happens to exceed it, and a large one fails when another
    # engine on the host already holds that RAM. A byte count does neither.
    # `VLLM_CPU_KVCACHE_SPACE` (GiB, vLLM's own knob) wins when set.
    if on_cpu and "gpu_memory_utilization" not in args and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        args.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_GIB * 1024**3)
    with contextlib.suppress(Exception):  # the checkpoint's own maximum context, where its config can be read
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args["model"], trust_remote_code=bool(args.get("trust_remote_code")))
        limit = getattr(getattr(config, "get_text_config", lambda: config)(), "max_position_embeddings", None)
        if limit and args.get("max_model_len") and args["max_model_len"] > limit:
            args["max_model_len"] = limit
    return args, placement


def eager_engine_processes(args: dict[str, Any], *, on_cpu: bool) -> None:
    """Call before starting a CPU engine. vLLM's CPU sampler is `torch.compile`d even under
    `enforce_eager`, so each new engine process has inductor probe and build C++ for the host's
    vector ISA before its first batch: about 20 s of a 58 s start on a 2-core host (measured),
    for a sampler as fast eager at caption batch sizes. The engine's process is spawned and
    reads this from the environment; TORCH_COMPILE_DISABLE=0 set by the user keeps the compile.
    With V1 multiprocessing off, vLLM's CPU platform runs the model in the engine's process (which
    AsyncLLM spawns anyway) instead of a worker spawned under it: one import of vLLM and torch fewer
    (built in 47-52 s instead of 71-83 s on 2 cores: docs/benchmarks.md). A user's =1 keeps the worker."""
    if on_cpu:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if on_cpu and args.get("enforce_eager"):
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


def _cuda_present() -> bool:
    """An NVIDIA (or ROCm) GPU vLLM runs on: where `device="cuda"` means something. vLLM's
    platform asks NVML, which, unlike `torch.cuda.is_available()`, leaves CUDA uninitialised in
    this process (vLLM may still fork its engine process)."""
    vllm_api.before_vllm_import()
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()
