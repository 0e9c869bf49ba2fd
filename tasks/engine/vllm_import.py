"""vLLM's import, made in the foreground by the first thread that needs it: it parses Python
source with `ast` over a hundred times (torch's overloads and dynamo polyfills, pydantic's field
docstrings, torchcodec), and Python 3.11's AST constructor keeps state that threads share (CPython
gh-106905: "SystemError: AST constructor recursion depth mismatch" when two parse at once). Where
each entry point imports it: docs/architecture.md; tests/test_preflight.py watches a run's start.
"""

from __future__ import annotations

import contextlib
import sys
import threading

from vlm_caption.tasks.engine import vllm_api
from vlm_caption.tasks.observability import phase

_LOCK = threading.Lock()


def ensure_vllm_imported() -> None:
    """vLLM imported before the flow's threads start: the engine's start, the fetch threads (the
    video loader) import parts of it, and transformers' lazy modules
    fail ("cannot import name 'AutoTokenizer'") when two threads import them at once. A second
    caller waits for the first's import."""
    if "vllm.multimodal.video" not in sys.modules:
        phase("loading vLLM")
    vllm_api.before_vllm_import()
    with _LOCK, contextlib.suppress(Exception):  # the engine's own import reports any failure
        import vllm.engine.arg_utils  # noqa: F401
        import vllm.multimodal.video  # noqa: F401
        from vllm import LLM  # noqa: F401

        # Imported by torch.compile's compiler, which the engine's build imports on its thread the
        # first time vLLM decorates a function with it; this module parses TorchScript source.
        import torch.utils.mkldnn  # noqa: F401
