"""vLLM's import on a thread of its own, started while the caller does something else first.

Importing vLLM (torch, CUDA, transformers, its kernels) is most of a run's time to its engine's
start. A flow run that starts its engine first (flows/plan.py `start_engine_first`) imports it on
a thread while it asks for its children and its slot; `vlm-caption run` imports it in the
foreground before Prefect, which would otherwise share the interpreter with it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading

# Importing vLLM otherwise runs logging.config.dictConfig, which shuts down every handler in the
# process -- Prefect's API log handler included, whose flush then deadlocks inside a running
# flow. With this, vLLM's warnings still reach the root logger that Prefect configures.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


def import_vllm_in_background() -> None:
    """Start importing vLLM on a thread, for a caller about to do something else first. The
    engine's build joins it (`ensure_vllm_imported`), as does the flow before its own threads
    start. The process also joins it before it exits, so an early error never tears down an
    interpreter mid-import. A second call does nothing."""
    global _IMPORTING
    if _IMPORTING is not None:
        return
    serialize_ast_parse()
    _IMPORTING = threading.Thread(target=_import_vllm, name="vllm-import", daemon=True)
    _IMPORTING.start()
    atexit.register(_IMPORTING.join)


def ensure_vllm_imported() -> None:
    """vLLM imported before the flow's threads start: the engine's start, the fetch threads (the
    video loader) and the render pool all import parts of it, and transformers' lazy modules
    fail ("cannot import name 'AutoTokenizer'") when two threads import them at once. Joins
    `import_vllm_in_background` when it was started, imports here otherwise."""
    if _IMPORTING is None:
        _import_vllm()
    else:
        _IMPORTING.join()


_IMPORTING: threading.Thread | None = None


def serialize_ast_parse() -> None:
    """One `ast.parse` at a time in this process, from here on.

    Python 3.11's AST constructor keeps its recursion depth in state that threads share, so two
    parses at once can fail with "SystemError: AST constructor recursion depth mismatch" (a fresh
    CI run, 2026-11-27). vLLM's import parses source over a hundred times (torch's overloads and
    dynamo polyfills, pydantic's field docstrings, torchcodec) on its thread, while the caller
    imports Prefect and the flow's modules, which parse too (pydantic, 26 times). Every one of
    them calls `ast.parse` through the module, so a lock around it covers them all; an import's
    own compile makes no AST objects and needs none."""
    import ast
    import functools

    if getattr(ast.parse, "serialized", False):
        return
    parse, lock = ast.parse, threading.RLock()

    @functools.wraps(parse)
    def serialized(*args, **kwargs):
        with lock:
            return parse(*args, **kwargs)

    serialized.serialized = True
    ast.parse = serialized


def _import_vllm() -> None:
    with contextlib.suppress(Exception):  # the engine's own import reports any failure
        import vllm.engine.arg_utils  # noqa: F401
        import vllm.multimodal.video  # noqa: F401
        from vllm import LLM  # noqa: F401
