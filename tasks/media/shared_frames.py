"""A decoded clip's frames handed from a decode-pool process to the process that asked for
them through a shared-memory block: pickled through ProcessPoolExecutor's one result pipe they
cap the whole pool (docs/benchmarks.md, "What holds the host side: the decode pool's result pipe").

A block is only used where /dev/shm has room to spare (a Docker container has 64 MB unless it
is started with `--shm-size` or `--ipc=host`): writing past a full tmpfs kills the writer with
SIGBUS, so below SHM_HEADROOM the frames go through the pipe.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from multiprocessing import shared_memory

SHM_FOLDER = "/dev/shm"
# Free space /dev/shm must keep, beyond what a block takes, for a block to be used: every pool
# process may be writing one at once, and vLLM's own queues live there too.
SHM_HEADROOM = 1 << 30


@dataclass(frozen=True)
class SharedFrames:
    """Where a clip's frames wait in shared memory, and how to read them back."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def take(self):
        """The frames as an array of this process's own; the block is removed."""
        import numpy as np

        block = shared_memory.SharedMemory(name=self.name)
        try:
            return np.ndarray(self.shape, np.dtype(self.dtype), buffer=block.buf).copy()
        finally:
            block.close()
            block.unlink()


def share_frames(frames):
    """`frames` (a numpy array) in a new shared-memory block, or `frames` themselves where
    /dev/shm lacks the room (the caller's `taken` then leaves them as they are)."""
    if not frames.nbytes:
        return frames
    if (free := shm_free_bytes()) < frames.nbytes + SHM_HEADROOM:
        _warn_once(free)
        return frames
    import numpy as np

    try:
        block = shared_memory.SharedMemory(create=True, size=frames.nbytes)
    except OSError:  # /dev/shm filled up meanwhile, or is not ours to write: through the pipe
        _warn_once(shm_free_bytes())
        return frames
    try:
        np.ndarray(frames.shape, frames.dtype, buffer=block.buf)[...] = frames
    except BaseException:
        block.close()
        block.unlink()
        raise
    block.close()
    return SharedFrames(block.name, tuple(frames.shape), frames.dtype.str)


def taken(frames):
    """The array `share_frames` handed over, read back here (or the array itself)."""
    return frames.take() if isinstance(frames, SharedFrames) else frames


_WARNED: list[int] = []  # the free space this process warned about, once


def _warn_once(free: int) -> None:
    if _WARNED:
        return
    _WARNED.append(free)
    logging.getLogger(__name__).warning(
        "/dev/shm has %d MB free: decoded clips come back from the decode pool through its pipe (about 30 "
        "clips/s); give the container more (docker run --shm-size 16g, or --ipc=host)", free >> 20)


def shm_free_bytes() -> int:
    """Free bytes of /dev/shm; 0 where there is none (macOS) or it cannot be read."""
    with contextlib.suppress(OSError):
        stats = os.statvfs(SHM_FOLDER)
        return stats.f_bavail * stats.f_frsize
    return 0
