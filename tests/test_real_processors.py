"""The real-processor matrix: recipes' prompts on tiny checkpoints through the CPU build of vLLM.

Each architecture runs in its own process (one engine per process, as in production).
"""

import json
import os
import subprocess
import sys

import pytest

from tests.checkpoints import build_checkpoint

# architecture (checkpoint builder) -> (recipe, modalities run through vLLM). Every recipe's
# prompts meet vLLM's processor in tests/test_recipe_checks.py (no engine, seconds each) and an
# engine on a GPU (python -m tests.recipe_check engine); CI starts CPU engines only for one of
# each kind of prompt: Qwen's image and video with their grids, chat parts for a group. LLaVA's
# plain placeholder is every flow test's (tests/test_e2e_flow.py checks its 64 image tokens).
MATRIX = {
    "qwen2_vl": ("qwen2_vl", ["image", "video"]),
    "gemma3": ("gemma3", ["multi-image", "image"]),  # engine sized by the first
}


@pytest.mark.parametrize("architecture", sorted(MATRIX))
def test_recipe_prompts_pass_real_vllm_processors(architecture, checkpoints_root):
    recipe, modalities = MATRIX[architecture]
    checkpoint = build_checkpoint(architecture, checkpoints_root)
    done = subprocess.run(
        [sys.executable, "-m", "tests.matrix_worker", recipe, str(checkpoint), *modalities],
        capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    causes = [line for line in done.stderr.splitlines() if "Error" in line or "error:" in line]
    assert done.returncode == 0, "\n".join(causes[-20:]) + "\n" + done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["modality"] for r in results] == modalities
    for result in results:
        assert result["output_tokens"] > 0
        assert result["prompt_tokens"] > len(result["prompt"]) // 8  # media placeholders were expanded
