"""Images are shrunk in the decode pool to what the model's processor would make of them, for
processors whose first step is a plain downscale; never enlarged; others are left alone."""

import json
import os
import subprocess
import sys
from pathlib import Path

from vlm_caption.tasks.media.pool import decode_images, decode_pool
from vlm_caption.tasks.media.resize import ProcessorResize, ResizeTarget, resize_target
from tests.images import image_bytes


def test_targets_come_from_the_checkpoint_processor(tmp_path):
    llava = tmp_path / "llava"
    llava.mkdir()
    (llava / "config.json").write_text(json.dumps({"model_type": "llava"}))
    (llava / "processor_config.json").write_text(json.dumps({"image_processor": {
        "image_processor_type": "CLIPImageProcessor", "do_center_crop": True, "size": {"shortest_edge": 336},
        "crop_size": {"height": 336, "width": 336}}}))
    assert resize_target(str(llava)) == ResizeTarget(shortest_edge=336, crop=(336, 336))

    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "max_pixels": 12845056}))
    # the processor's own resize, with the recipe's limit (tests/test_processor_device.py checks its pixels)
    assert resize_target(str(qwen), {"max_pixels": 1003520}) == ProcessorResize(str(qwen), (("max_pixels", 1003520),),
                                                                                "image")

    tiles = tmp_path / "next"
    tiles.mkdir()
    (tiles / "config.json").write_text(json.dumps({"model_type": "llava_next"}))  # any-res tiling
    (tiles / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "do_center_crop": True, "size": {"shortest_edge": 336}}))
    assert resize_target(str(tiles)) is None
    assert resize_target(str(tmp_path / "missing")) is None


def test_shrinks_keep_aspect_and_never_enlarge(monkeypatch):
    monkeypatch.setenv("VLM_CAPTION_DECODE_PROCESSES", "0")
    from vlm_caption.tasks.settings import get_settings

    get_settings.cache_clear()
    big, small = image_bytes(size=(1920, 1080)), image_bytes(size=(200, 100))
    shrunk, untouched = decode_images([big, small], 10**8, ResizeTarget(shortest_edge=336))
    assert shrunk.size == (597, 336) and untouched.size == (200, 100)
    cropped, tall, small = decode_images([big, image_bytes(size=(400, 900)), image_bytes(size=(200, 100))], 10**8,
                                         ResizeTarget(shortest_edge=336, crop=(336, 336)))
    assert cropped.size == tall.size == (336, 336) and small.size == (200, 100)  # a small one HF pads: left as is
    (capped,) = decode_images([big], 10**8, ResizeTarget(max_pixels=640 * 480))
    assert capped.size[0] * capped.size[1] <= 640 * 480 * 1.01 and abs(capped.size[0] / capped.size[1] - 16 / 9) < 0.01
    get_settings.cache_clear()


def test_the_pool_returns_every_image_in_order(monkeypatch):
    monkeypatch.setenv("VLM_CAPTION_DECODE_PROCESSES", "2")
    from vlm_caption.tasks.settings import get_settings

    get_settings.cache_clear()
    images = decode_images([image_bytes(size=(64 + i, 48)) for i in range(4)], 10**6, None)
    assert [im.size for im in images] == [(64 + i, 48) for i in range(4)]
    # The workers yield the CPU to the engine's scheduler and the feed (nice 10 below this process).
    assert decode_pool().submit(os.nice, 0).result() == min(os.nice(0) + 10, 19)
    get_settings.cache_clear()


def test_videos_are_decoded_in_the_pools_processes(monkeypatch):
    """Where VLM_CAPTION_VIDEO_DECODE_IN_POOL says (by default, `auto`: where a GPU is seen) a
    video is decoded in a pool process, not by the fetch thread that asked (a process decodes one
    video at a time): the frames are those this process would decode, a broken clip is the same
    error record; on a machine without a GPU, with `false`, or with VLM_CAPTION_DECODE_PROCESSES=0,
    the caller decodes. A video run starts the pool's processes beside the engine."""
    from multiprocessing import shared_memory

    import numpy as np
    import pytest

    import vlm_caption.tasks.media.pool as pool
    from vlm_caption.tasks.media.image import MediaError
    from vlm_caption.tasks.media.shared_frames import SharedFrames, taken
    from vlm_caption.tasks.media.video import VideoLimits, decode_video
    from vlm_caption.tasks.settings import get_settings
    from tests.images import video_bytes

    limits, clip = VideoLimits(max_seconds=600, max_frame_pixels=10**7), video_bytes(frames=16, seed=3)
    here = decode_video(clip, num_frames=4, limits=limits)

    def not_here(*args, **kwargs):
        raise AssertionError("decoded in the caller's process")

    monkeypatch.setattr(pool, "decode_video", not_here)  # the pool's processes import their own
    monkeypatch.setenv("VLM_CAPTION_DECODE_PROCESSES", "1")  # one pool process: one import of vLLM
    # At the pool's nice 10 beside a loaded machine's own work (stress --cpu 4) a pool process gets a
    # sliver of a core: its import of vLLM's loader took over 10 minutes there. Priority is not what
    # this test is about.
    monkeypatch.setenv("VLM_CAPTION_DECODE_NICENESS", "0")
    get_settings.cache_clear()
    monkeypatch.setattr(pool, "_sees_a_gpu", lambda: False)
    with pytest.raises(AssertionError, match="caller"):  # auto, and no GPU: here
        pool.decode_video_pooled(clip, num_frames=4, limits=limits)
    monkeypatch.setenv("VLM_CAPTION_VIDEO_DECODE_IN_POOL", "true")
    get_settings.cache_clear()
    monkeypatch.setattr(pool, "_POOL", None)  # a pool made now is made for videos
    monkeypatch.setattr(pool, "_POOL_SIZE", 0)
    pool.start_decode_pool("video")
    assert len(pool._POOL._processes) == 1  # started before any clip, its loader imported as it starts
    assert pool._POOL.submit(os.getenv, "OMP_NUM_THREADS").result() == "1"  # VLM_CAPTION_DECODE_THREADS
    # forked from the pool's fork server, which imported vLLM's loader once: not spawned by this
    # process, which would have each import this process's main module and the loader again
    assert pool._POOL.submit(os.getppid).result() != os.getpid()
    handed = []
    monkeypatch.setattr(pool, "taken", lambda frames: handed.append(frames) or taken(frames))
    pooled = pool.decode_video_pooled(clip, num_frames=4, limits=limits)
    assert np.array_equal(pooled.frames, here.frames) and pooled.metadata == here.metadata
    # the frames came through shared memory, and the block is gone once read back
    assert [type(frames) for frames in handed] == [SharedFrames]
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=handed[0].name)
    with pytest.raises(MediaError) as broken:
        pool.decode_video_pooled(b"not a video at all", num_frames=4, limits=limits)
    assert broken.value.error.kind == "decode" and broken.value.error.message
    monkeypatch.setenv("VLM_CAPTION_VIDEO_DECODE_IN_POOL", "auto")
    monkeypatch.setattr(pool, "_sees_a_gpu", lambda: True)
    get_settings.cache_clear()
    assert pool.videos_in_pool()  # auto, on a GPU host: in the pool
    monkeypatch.setenv("VLM_CAPTION_VIDEO_DECODE_IN_POOL", "false")
    get_settings.cache_clear()
    with pytest.raises(AssertionError, match="caller"):
        pool.decode_video_pooled(clip, num_frames=4, limits=limits)
    monkeypatch.setenv("VLM_CAPTION_VIDEO_DECODE_IN_POOL", "true")
    monkeypatch.setenv("VLM_CAPTION_DECODE_PROCESSES", "0")
    get_settings.cache_clear()
    with pytest.raises(AssertionError, match="caller"):
        pool.decode_video_pooled(clip, num_frames=4, limits=limits)
    pool._POOL.shutdown()
    get_settings.cache_clear()


def test_the_processor_sees_the_pixels_it_would_have_made_itself():
    """CLIP's processor over the shrunk and cropped image gives the pixel values it gives over
    the original: same size, same crop offsets (one pixel of rounding would shift the grid)."""
    import numpy as np
    from PIL import Image
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    target = ResizeTarget(shortest_edge=336, crop=(336, 336))
    rng = np.random.default_rng(0)
    for width, height in ((1920, 1080), (1080, 1920), (641, 479), (1001, 997)):
        noise = rng.normal(128, 50, (height, width, 3))  # noise: any shift of the grid shows
        image = Image.fromarray(np.clip(noise, 0, 255).astype(np.uint8))
        shrunk = target.apply(image)
        assert shrunk.size == (336, 336)
        original, ours = (np.asarray(processor(im, return_tensors="np")["pixel_values"]) for im in (image, shrunk))
        assert original.shape == ours.shape and float(np.abs(original - ours).mean()) < 1e-3, (width, height)


def test_a_pool_made_for_videos_is_capped_and_an_image_pool_is_not(monkeypatch):
    """Each process of a video pool holds vLLM's loader (about 0.4 GB): one per core of a big host
    would be tens of GB. Unless VLM_CAPTION_DECODE_PROCESSES names a number, a pool made for videos
    has at most VIDEO_POOL_PROCESSES; an image pool one per core. (No process is started here.)"""
    import vlm_caption.tasks.media.pool as pool
    from vlm_caption.tasks.settings import get_settings

    monkeypatch.delenv("VLM_CAPTION_DECODE_PROCESSES", raising=False)
    monkeypatch.setattr(pool, "usable_cores", lambda: 40)
    monkeypatch.setattr(pool, "_POOL_SIZE", 0)
    get_settings.cache_clear()
    sizes = {}
    for for_videos in (True, False):
        monkeypatch.setattr(pool, "_POOL", None)
        pool.decode_pool(for_videos=for_videos)
        sizes[for_videos] = pool._POOL_SIZE
        pool._POOL.shutdown()
    assert sizes == {True: pool.VIDEO_POOL_PROCESSES, False: 40}
    monkeypatch.setenv("VLM_CAPTION_DECODE_PROCESSES", "24")
    get_settings.cache_clear()
    monkeypatch.setattr(pool, "_POOL", None)
    pool.decode_pool(for_videos=True)
    assert pool._POOL_SIZE == 24  # the user's number holds
    pool._POOL.shutdown()
    get_settings.cache_clear()


def test_frames_cross_through_shared_memory_only_where_there_is_room(monkeypatch, caplog):
    """A decoded clip's frames go from a pool process to the caller in a shared-memory block,
    read back equal and the block removed; where /dev/shm lacks room (a Docker container's 64 MB),
    or for nothing at all, the frames themselves go (through the pool's pipe, as before)."""
    from multiprocessing import shared_memory

    import numpy as np
    import pytest

    import vlm_caption.tasks.media.shared_frames as shared

    frames = np.arange(4 * 6 * 8 * 3, dtype=np.uint8).reshape(4, 6, 8, 3)
    monkeypatch.setattr(shared, "shm_free_bytes", lambda: 4 << 30)
    handle = shared.share_frames(frames)
    assert isinstance(handle, shared.SharedFrames) and handle.shape == frames.shape
    assert np.array_equal(shared.taken(handle), frames)
    with pytest.raises(FileNotFoundError):  # removed once read
        shared_memory.SharedMemory(name=handle.name)
    assert shared.share_frames(frames[:0]).shape == (0, 6, 8, 3)  # nothing to hand over: as it is
    def refused(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as full:  # filled up after the check: the pipe, not a failed item
        full.setattr(shared.shared_memory, "SharedMemory", refused)
        assert shared.share_frames(frames) is frames
    monkeypatch.setattr(shared, "shm_free_bytes", lambda: shared.SHM_HEADROOM + frames.nbytes - 1)
    monkeypatch.setattr(shared, "_WARNED", [])
    caplog.clear()
    with caplog.at_level("WARNING", logger=shared.__name__):
        assert shared.share_frames(frames) is frames and shared.taken(frames) is frames
        monkeypatch.setattr(shared, "shm_free_bytes", lambda: 0)
        shared.share_frames(frames)
    said = ("/dev/shm has 1024 MB free: decoded clips come back from the decode pool through its pipe (about 30 "
            "clips/s); give the container more (docker run --shm-size 16g, or --ipc=host)")
    assert [r.getMessage() for r in caplog.records] == [said]  # once, with what to do


def test_a_decode_process_keeps_torch_and_opencv_to_its_threads():
    """VLM_CAPTION_DECODE_THREADS: each decode process gives torch and OpenCV that many threads
    (set on what is imported, and in the environment for what is imported later): with their
    defaults, one per core in every pool process, a 32-core host's 16-process pool decoded
    27.6 clips/s on one GPU's 16 cores, 31.6 at one thread each. Checked in a new process, as
    the pool's are spawned: an engine in this one (the tests run vLLM's engine core in-process)
    has replaced torch.set_num_threads with a no-op, as vLLM's CPU worker does."""
    code = ("import os, cv2, torch\n"
            "from vlm_caption.tasks.media.pool import keep_to_threads\n"
            "assert cv2.getNumThreads() == 8\n"
            "keep_to_threads(1)\n"
            "print(torch.get_num_threads(), cv2.getNumThreads(),"
            " os.environ['OMP_NUM_THREADS'], os.environ['OPENCV_FOR_THREADS_NUM'])\n")
    env = {**os.environ, "OMP_NUM_THREADS": "8", "OPENCV_FOR_THREADS_NUM": "8"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "1", "1", "1"]  # from the environment's 8 to one each
