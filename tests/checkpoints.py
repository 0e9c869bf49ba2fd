"""Tiny random-weight checkpoints for tests: one builder per architecture, shared by suites.

`build_checkpoint("llava", folder)` writes a checkpoint real vLLM can load. Builders are cached
per folder, so several suites in one session share the same files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tasks.tiny_checkpoint import build_tiny_llava, build_tiny_qwen2_5_vl, build_tiny_qwen2_vl
from tests.tiny_gemma3 import build_tiny_gemma3
from tests.tiny_idefics3 import build_tiny_idefics3
from tests.tiny_llava_next import build_tiny_llava_next
from tests.tiny_paligemma import build_tiny_paligemma

BUILDERS: dict[str, Callable[[Path], Path]] = {
    "llava": build_tiny_llava,
    "qwen2_vl": build_tiny_qwen2_vl,
    "qwen2_5_vl": build_tiny_qwen2_5_vl,
    "paligemma": build_tiny_paligemma,
    "idefics3": build_tiny_idefics3,
    "llava_next": build_tiny_llava_next,
    "gemma3": build_tiny_gemma3,
}


def build_checkpoint(architecture: str, root: Path) -> Path:
    return BUILDERS[architecture](root / architecture)
