"""Run recipes' prompts through real vLLM on a tiny checkpoint; print one JSON line per request.

    python -m tests.matrix_worker RECIPE CHECKPOINT MODALITY [MODALITY ...]
vLLM rejects a prompt whose placeholders do not match what its processor expects, so a
completed request proves the recipe's format, not just its string.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def media_for(modality: str):
    from PIL import Image

    if modality == "video":
        return "video", np.random.default_rng(0).integers(0, 255, (4, 56, 56, 3), dtype=np.uint8)
    if modality == "multi-image":
        return "image", [Image.new("RGB", (120, 90), (200, 30, 30)), Image.new("RGB", (90, 120), (30, 30, 200))]
    return "image", Image.new("RGB", (160, 120), (30, 160, 60))


def main(recipe_name: str, checkpoint: str, modalities: list[str]) -> None:
    from vllm import LLM, SamplingParams

    from vlm_caption.recipes import get_recipe
    from vlm_caption.recipes.requests import build_requests
    from vlm_caption.tasks.engine.arguments import EngineSpec, eager_engine_processes, engine_plan

    recipe = get_recipe(recipe_name)
    args, _ = engine_plan(EngineSpec.build(recipe, modality=modalities[0], model=checkpoint, images=2), on_cpu=True)
    # A tiny model needs little KV cache; CI runs this beside other engines on one small machine.
    args["kv_cache_memory_bytes"] = 512 * 1024**2
    args["limit_mm_per_prompt"] = {"image": 2 if "multi-image" in modalities else 1,
                                   "video": 1 if "video" in modalities else 0}
    eager_engine_processes(args, on_cpu=True)
    llm = LLM(**args)
    tokenizer = llm.get_tokenizer()
    for modality in modalities:
        kind, media = media_for(modality)
        built = build_requests(recipe, modality, ["What is in it?"], images=2, model=checkpoint,
                               tokenizer=tokenizer if recipe.uses_chat_template(modality) else None)
        prompt = built.requests[0].prompt
        out = llm.generate([{"prompt": prompt, "multi_modal_data": {kind: media}}],
                           SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
        print(json.dumps({"modality": modality, "prompt": prompt, "prompt_tokens": len(out.prompt_token_ids),
                          "output_tokens": len(out.outputs[0].token_ids)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
