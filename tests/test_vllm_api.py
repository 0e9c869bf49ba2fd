"""What the project names in vLLM (tasks/engine/vllm_api.py), checked against the installed vLLM,
so that an upgrade that changes any of it fails here, by name, rather than in a run: the engine
arguments recorded for vLLM 0.26.0, `AsyncLLM` built as the offline `LLM` sizes itself, its
`vllm_config` and `EngineDeadError`. And, with real engines on tiny checkpoints: the requests the
product hands `AsyncLLM` are the very prompts `LLM.generate` and `LLM.chat` make of the example's
input (the same prompt token ids, the same greedy tokens), and a killed engine process fails the
requests waiting on it at once."""

from __future__ import annotations

import dataclasses
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vlm_caption.tasks.engine import vllm_api
from tests.processes import engine_core_pids


def test_the_recorded_engine_arguments_are_the_installed_vllms():
    """A misspelled `--engine-arg` is refused from the names recorded for vLLM 0.26.0: they must be
    exactly `EngineArgs`' fields. After an upgrade, record them again (`RECORDED_VERSION` too)."""
    from vllm.engine.arg_utils import EngineArgs

    assert vllm_api.installed_version() == vllm_api.RECORDED_VERSION, "record this vLLM's EngineArgs fields"
    fields, recorded = {field.name for field in dataclasses.fields(EngineArgs)}, vllm_api.ENGINE_ARGUMENTS
    assert fields == recorded, f"EngineArgs gained {sorted(fields - recorded)} and lost {sorted(recorded - fields)}"


CHECK_OVERRIDES = """
import sys
from vlm_caption.recipes import RecipeError
from vlm_caption.tasks.engine import vllm_api
from vlm_caption.tasks.engine.arguments import check_engine_overrides

def refusal(**check):
    try:
        check_engine_overrides({"max_model_length": 4096}, **check)
    except RecipeError as error:
        return str(error)

print(refusal(), "vllm" in sys.modules)
vllm_api.installed_version = lambda: "0.0.1"  # a release whose arguments are not recorded
print(refusal(), "vllm" in sys.modules)
print(refusal(import_vllm=True), "vllm" in sys.modules)
"""


def test_a_misspelled_engine_argument_is_refused_before_vllm_is_imported():
    """The pinned release's names answer at once; another release's are checked once vLLM is
    imported (where the engine is built), never guessed."""
    run = subprocess.run([sys.executable, "-c", CHECK_OVERRIDES], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert run.returncode == 0, run.stderr[-3000:]
    recorded, unrecorded, imported = [line for line in run.stdout.splitlines()  # vLLM logs to stdout too
                                      if line.startswith(("unknown vLLM engine argument", "None "))]
    hint = "unknown vLLM engine argument 'max_model_length'. Did you mean: max_model_len"
    assert recorded.startswith(hint) and recorded.endswith(" False")  # refused, vLLM not imported
    assert unrecorded == "None False"  # left to the engine's build
    assert imported.startswith(hint) and imported.endswith(" True")


def test_the_engine_is_vllms_async_engine_sized_as_the_offline_class():
    import vllm
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine import exceptions
    from vllm.v1.engine.async_llm import AsyncLLM

    assert vllm.AsyncLLMEngine is AsyncLLM
    assert "usage_context" in inspect.signature(AsyncLLM.from_engine_args).parameters
    assert UsageContext.LLM_CLASS.name == "LLM_CLASS"
    assert "vllm_config" in inspect.unwrap(AsyncLLM.__init__).__code__.co_names
    assert {"errored", "shutdown", "generate", "get_tokenizer"} <= set(dir(AsyncLLM))
    assert vllm_api.is_dead_engine_error(exceptions.EngineDeadError())
    assert not vllm_api.is_dead_engine_error(RuntimeError("a request's own error"))


QUESTION = "What is in the picture?"


def _images(count: int):
    from PIL import Image

    return [Image.new("RGB", (64 + 16 * i, 48), (40 * i, 120, 200)) for i in range(count)]


@pytest.mark.parametrize(("family", "modality", "method", "pictures"), [
    ("llava", "image", "generate", 1),
    ("idefics3", "multi-image", "generate", 2),
    ("idefics3", "multi-image", "chat", 2),
])
def test_the_engines_prompts_are_the_ones_llm_makes(checkpoints_root, family, modality, method, pictures):
    """The product's request for an item (tasks/engine/vllm_engine.py) through `AsyncLLM` gives the
    prompt token ids and greedy tokens that `LLM.generate` (the recipe's prompt) or `LLM.chat` (the
    multi-image example's conversation: the question, then the pictures) give for it."""
    from vllm import LLM

    from vlm_caption.recipes import get_recipe
    from vlm_caption.tasks.engine.arguments import EngineSpec
    from vlm_caption.tasks.engine.vllm_engine import CaptionEngine, EngineRequest, Sampling
    from tests.checkpoints import build_checkpoint

    model = str(build_checkpoint(family, checkpoints_root))
    spec = EngineSpec.build(get_recipe(family), modality=modality, model=model, images=pictures)
    images = _images(pictures)
    media = images if modality == "multi-image" else images[0]
    uuids = [f"picture-{i}" for i in range(pictures)] if modality == "multi-image" else "picture-0"
    engine = CaptionEngine(spec)
    try:
        params = engine.sampling_params(Sampling(max_tokens=6))
        request = EngineRequest(QUESTION, media, uuids, count=pictures)
        ours = engine._feed.submit(engine._prompt(request, method), params,
                                   tokenization={"add_special_tokens": False} if method == "chat" else None).result(600)
        prompt = engine.prompt_for(QUESTION, pictures)
        args = dict(engine.args)
    finally:
        engine.release()
    llm = LLM(**args)
    if method == "generate":
        (theirs,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": media}}, params, use_tqdm=False)
    else:
        parts = [{"type": "image_pil", "image_pil": image} for image in images]
        (theirs,) = llm.chat([{"role": "user", "content": [{"type": "text", "text": QUESTION}, *parts]}], params,
                             use_tqdm=False, chat_template=spec.recipe.prompting(modality).chat_template)
    del llm
    assert ours.prompt_token_ids == theirs.prompt_token_ids
    assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids


def test_a_killed_engine_process_fails_the_requests_waiting_on_it(tiny_llava):
    """`AsyncLLM` raises to every waiter when its engine process dies: the shard's requests fail
    with `EngineDied` (the shard is retried on a new engine), none waits forever."""
    from vlm_caption.recipes import get_recipe
    from vlm_caption.tasks.engine.arguments import EngineSpec
    from vlm_caption.tasks.engine.feed import EngineDied
    from vlm_caption.tasks.engine.vllm_engine import CaptionEngine, EngineRequest, Sampling

    engine = CaptionEngine(EngineSpec.build(get_recipe("llava"), model=str(tiny_llava)))
    (image,) = _images(1)
    raised: list[BaseException] = []

    def generate_long():
        try:
            engine.run([EngineRequest(QUESTION, image, "long")], Sampling(max_tokens=900, ignore_eos=True))
        except BaseException as error:  # noqa: BLE001 - what the waiting request raised
            raised.append(error)

    waiting = threading.Thread(target=generate_long, daemon=True)
    waiting.start()
    time.sleep(2)
    assert waiting.is_alive(), raised
    for pid in engine_core_pids():
        os.kill(pid, signal.SIGKILL)
    waiting.join(timeout=60)
    assert not waiting.is_alive(), "still waiting on a dead engine"
    assert len(raised) == 1 and isinstance(raised[0], EngineDied) and engine.dead, raised
    engine.release()  # a dead engine's release returns


def test_a_cpu_engine_runs_its_model_in_the_engines_own_process(tiny_llava, monkeypatch):
    """On a CPU vLLM would run the model in a worker process spawned under the engine's process,
    importing vLLM and torch once more (71-83 s builds against 47-52 s on 2 cores, docs/benchmarks.md): the
    product's CPU engines turn V1 multiprocessing off (tasks/engine/arguments.py), so the engine's
    process is the only one it starts, and it captions."""
    import psutil

    from vlm_caption.recipes import get_recipe
    from vlm_caption.tasks.engine.arguments import EngineSpec
    from vlm_caption.tasks.engine.vllm_engine import CaptionEngine, EngineRequest, Sampling

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # the tests' own setting, tests/conftest.py
    engine = CaptionEngine(EngineSpec.build(get_recipe("llava"), model=str(tiny_llava)))
    try:
        (output,) = engine.run([EngineRequest(QUESTION, _images(1)[0], "picture-0")], Sampling(max_tokens=4))
        (core,) = engine_core_pids()
        below = [p.cmdline() for p in psutil.Process(core).children(recursive=True) if p.is_running()]
    finally:
        engine.release()
    assert output.error is None and output.output_tokens == 4
    assert below == [], below
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
