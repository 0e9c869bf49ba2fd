"""Where the model's processor runs (GPU present or not, a checked fast processor or not, the
user's override), what the engine arguments then say, and that frames shrunk in the fetch
threads give vLLM's processor exactly what it would have made of the full frames."""

import os

import numpy as np
import pytest

from vlm_caption.recipes import RecipeError, get_recipe
from vlm_caption.tasks.engine import arguments
from vlm_caption.tasks.engine.arguments import EngineSpec, engine_plan, frame_resize_target, image_resize_target
from vlm_caption.tasks.engine.processor import PROCESSOR_GPU_GIB, place_processor
from tests.checkpoints import build_checkpoint
from tests.vllm_processing import process, tensors


@pytest.mark.parametrize(("recipe", "requested", "gpu", "device", "why"), [
    ("qwen2_vl", "auto", True, "cuda", "fast (torch) processor"),
    ("qwen2_5_vl", "auto", True, "cuda", "fast (torch) processor"),
    ("qwen2_vl", "auto", False, "cpu", "no GPU"),
    ("qwen2_vl", "cpu", True, "cpu", "asked for"),
    ("llava", "auto", True, "cpu", "not checked on the GPU"),
    ("llava", "cuda", True, "cuda", "asked for"),
    ("qwen_vl", "auto", True, "cpu", "repository's own code"),
])
def test_the_processor_goes_to_the_gpu_only_where_it_is_fast_and_checked(recipe, requested, gpu, device, why):
    placement = place_processor(get_recipe(recipe), requested, gpu=gpu)
    assert placement.device == device and why in placement.reason


def test_the_engine_argument_wins_and_cuda_without_a_gpu_is_refused():
    placement = place_processor(get_recipe("qwen2_vl"), "auto", gpu=True, user_kwargs={"device": "cpu"})
    assert placement.device == "cpu" and "mm_processor_kwargs" in placement.reason
    with pytest.raises(RecipeError, match="needs an NVIDIA GPU"):
        place_processor(get_recipe("qwen2_vl"), "cuda", gpu=False)


def test_on_a_gpu_the_engine_arguments_carry_the_device_and_the_memory_it_needs(monkeypatch):
    monkeypatch.setattr(arguments, "_cuda_present", lambda: True)
    args, placement = engine_plan(EngineSpec.build(get_recipe("qwen2_vl"), modality="video", model="/none"), on_cpu=False)
    assert placement.device == "cuda"
    # the recipe's pixel limits stay; vLLM takes the processor's memory off its KV cache
    assert args["mm_processor_kwargs"] == {"min_pixels": 784, "max_pixels": 1003520, "device": "cuda"}
    assert args["mm_ipc_gpu_memory_gb"] == PROCESSOR_GPU_GIB
    # multi-image leaves the pixel limits at the processor's own: only the device is set
    args, _ = engine_plan(EngineSpec.build(get_recipe("qwen2_vl"), modality="multi-image", model="/none", images=2), on_cpu=False)
    assert args["mm_processor_kwargs"] == {"device": "cuda"}
    args, placement = engine_plan(EngineSpec.build(get_recipe("qwen2_vl"), model="/none", processor_device="cpu",
                                                   engine_overrides={"mm_ipc_gpu_memory_gb": 4}), on_cpu=False)
    assert placement.device == "cpu" and "device" not in args["mm_processor_kwargs"]
    assert args["mm_ipc_gpu_memory_gb"] == 4  # the caller's own value


def test_a_fixed_kv_cache_smaller_than_the_processors_share_is_refused_up_front(monkeypatch):
    """On the H100 this failed vLLM's start: 'reserves 2.0 GiB ... only 0.25 GiB is available'."""
    monkeypatch.setattr(arguments, "_cuda_present", lambda: True)
    small = EngineSpec.build(get_recipe("qwen2_vl"), model="/none", engine_overrides={"kv_cache_memory_bytes": 256 * 1024**2})
    with pytest.raises(RecipeError, match="--processor-device cpu"):
        engine_plan(small, on_cpu=False)
    enough = EngineSpec.build(get_recipe("qwen2_vl"), model="/none", engine_overrides={"kv_cache_memory_bytes": 3 * 1024**3})
    assert engine_plan(enough, on_cpu=False)[1].device == "cuda"
    on_cpu = EngineSpec.build(get_recipe("qwen2_vl"), model="/none", processor_device="cpu",
                              engine_overrides={"kv_cache_memory_bytes": 256 * 1024**2})
    assert engine_plan(on_cpu, on_cpu=False)[1].device == "cpu"


def test_on_cpu_nothing_changes():
    args, placement = engine_plan(EngineSpec.build(get_recipe("qwen2_vl"), model="/none"), on_cpu=True)
    assert placement.device == "cpu" and placement.reason == "no GPU on this machine"
    assert "device" not in args["mm_processor_kwargs"] and "mm_ipc_gpu_memory_gb" not in args


def test_cpu_engines_start_without_inductor_unless_the_user_keeps_it(monkeypatch):
    """vLLM compiles its CPU sampler even under enforce_eager (20 s of each engine start on 2
    cores); the engine's process (AsyncLLM's, always spawned) reads TORCH_COMPILE_DISABLE from
    the environment."""
    from vlm_caption.tasks.engine.arguments import eager_engine_processes

    cpu_args = engine_plan(EngineSpec.build(get_recipe("llava"), model="/none"), on_cpu=True)[0]
    gpu_args = engine_plan(EngineSpec.build(get_recipe("llava"), model="/none"), on_cpu=False)[0]
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    eager_engine_processes(gpu_args, on_cpu=False)
    assert "TORCH_COMPILE_DISABLE" not in os.environ  # a GPU engine compiles as vLLM decides
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    eager_engine_processes(cpu_args, on_cpu=True)
    assert os.environ["TORCH_COMPILE_DISABLE"] == "0"  # the user keeps the compile
    monkeypatch.delenv("TORCH_COMPILE_DISABLE")
    eager_engine_processes(cpu_args, on_cpu=True)
    assert cpu_args["enforce_eager"] is True and os.environ["TORCH_COMPILE_DISABLE"] == "1"


def test_cpu_engines_run_their_model_in_the_engines_process_unless_the_user_asks_otherwise(monkeypatch):
    """The engine's process runs the model on a CPU (no worker process of vLLM's spawned under
    it); a GPU engine is left to vLLM; a user's VLLM_ENABLE_V1_MULTIPROCESSING=1 is kept."""
    from vlm_caption.tasks.engine.arguments import eager_engine_processes

    args = engine_plan(EngineSpec.build(get_recipe("llava"), model="/none"), on_cpu=True)[0]
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    eager_engine_processes(args, on_cpu=False)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    eager_engine_processes(args, on_cpu=True)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    eager_engine_processes(args, on_cpu=True)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_cpu_engines_skip_the_multimodal_memory_profile_unless_the_job_asks_for_it():
    """On CPU the KV cache is sized in bytes, so vLLM's start-up run of the vision encoder over its
    largest dummy batch measures nothing; a GPU engine still profiles, and the job's engine
    overrides win."""
    cpu_args = engine_plan(EngineSpec.build(get_recipe("qwen2_vl"), modality="video", model="/none"), on_cpu=True)[0]
    gpu_args = engine_plan(EngineSpec.build(get_recipe("qwen2_vl"), modality="video", model="/none"), on_cpu=False)[0]
    asked = EngineSpec.build(get_recipe("qwen2_vl"), modality="video", model="/none", engine_overrides={"skip_mm_profiling": False})
    assert cpu_args["skip_mm_profiling"] is True and "skip_mm_profiling" not in gpu_args
    assert engine_plan(asked, on_cpu=True)[0]["skip_mm_profiling"] is False


def test_a_job_takes_the_processor_device_from_the_command_line():
    from vlm_caption.flows.cli import build_parser
    from vlm_caption.flows.cli_job import job_fields

    args = build_parser().parse_args(["run", "/in", "--out", "/out", "--recipe", "qwen2_vl",
                                      "--processor-device", "cpu"])
    assert job_fields(args)["processor_device"] == "cpu"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "/in", "--out", "/out", "--processor-device", "tpu"])


@pytest.mark.parametrize("architecture", ["qwen2_vl", "qwen2_5_vl"])
def test_frames_shrunk_in_the_fetch_threads_are_what_vllm_makes_of_the_full_frames(architecture, tmp_path):
    """The same prompt tokens, grid and pixel values, bit for bit, from 640x480 frames and from
    those frames shrunk first with the video processor's own resize."""
    model = str(build_checkpoint(architecture, tmp_path))
    kwargs = get_recipe(architecture).engine_args_for("video", model=model)["mm_processor_kwargs"]
    target = frame_resize_target(EngineSpec.build(get_recipe(architecture), modality="video", model=model))
    assert target is not None
    frames = np.random.default_rng(0).integers(0, 255, (4, 480, 640, 3), dtype=np.uint8)
    small = target.apply(frames)
    assert small.shape[0] == 4 and small.shape[1] * small.shape[2] < 480 * 640 and small.dtype == np.uint8
    prompt = "<|vision_start|><|video_pad|><|vision_end|>Describe."
    full, shrunk = process(model, prompt, {"video": frames}, kwargs), process(model, prompt, {"video": small}, kwargs)
    assert full["prompt_token_ids"] == shrunk["prompt_token_ids"]
    a, b = tensors(full), tensors(shrunk)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    assert target.apply(small) is small  # already at its size: left as it is


@pytest.mark.parametrize("architecture", ["qwen2_vl", "qwen2_5_vl"])
def test_photos_shrunk_in_the_decode_pool_are_what_vllm_makes_of_the_full_photos(architecture, tmp_path):
    """Photos and pairs: the decode pool resizes with the image processor's own resize, so vLLM's
    processor (on the GPU too) only rescales and patchifies the very pixels the CPU path has."""
    from PIL import Image

    model = str(build_checkpoint(architecture, tmp_path))
    rng = np.random.default_rng(1)
    photos = [Image.fromarray(rng.integers(0, 255, (480 + 37 * i, 640 + 53 * i, 3), dtype=np.uint8)) for i in range(2)]
    for modality, prompt, count in (("image", "<|vision_start|><|image_pad|><|vision_end|>Hi", 1),
                                    ("multi-image", "<|vision_start|><|image_pad|><|vision_end|>" * 2 + "Hi", 2)):
        spec = EngineSpec.build(get_recipe(architecture), modality=modality, model=model, images=count)
        target = image_resize_target(spec)
        kwargs = get_recipe(architecture).engine_args_for(modality, model=model, images=count).get("mm_processor_kwargs")
        media = photos[:count] if count > 1 else photos[0]
        small = [target.apply(p) for p in photos[:count]]
        assert all(s.size[0] * s.size[1] < p.size[0] * p.size[1] for s, p in zip(small, photos))
        full = process(model, prompt, {"image": media}, kwargs)
        shrunk = process(model, prompt, {"image": small if count > 1 else small[0]}, kwargs)
        assert full["prompt_token_ids"] == shrunk["prompt_token_ids"]
        a, b = tensors(full), tensors(shrunk)
        assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_frames_are_left_alone_for_processors_that_are_not_known(tmp_path):
    llava = str(build_checkpoint("llava", tmp_path))
    assert frame_resize_target(EngineSpec.build(get_recipe("qwen2_vl"), modality="video", model=llava)) is None  # no video processor
    assert frame_resize_target(EngineSpec.build(get_recipe("qwen2_vl"), modality="video", model=str(tmp_path / "no"))) is None
    assert frame_resize_target(EngineSpec.build(get_recipe("qwen2_vl"), modality="image", model=llava)) is None
