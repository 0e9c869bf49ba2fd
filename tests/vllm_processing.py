"""vLLM's own multimodal processor for a checkpoint, applied without an engine (as vLLM's tests in
`tests/models/multimodal/processing` use it): what the engine would get for a prompt and its media."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


def process(model: str, prompt: str, media: dict[str, Any], mm_processor_kwargs: dict[str, Any] | None = None,
            max_model_len: int | None = None, **model_config: Any) -> dict[str, Any]:
    """{"prompt_token_ids": [...], "mm_kwargs": {modality: [item, ...]}, "mm_placeholders": ...} as vLLM
    0.26 builds it; `model_config` takes other `ModelConfig` fields (hf_overrides, limit_mm_per_prompt)."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    config = ModelConfig(model=model, mm_processor_kwargs=mm_processor_kwargs, max_model_len=max_model_len,
                         **model_config)
    processor = MULTIMODAL_REGISTRY.create_processor(config)
    items = processor.info.parse_mm_data(media)
    return processor.apply(ProcessorInputs(prompt, items), TimingContext(enabled=False))


def tensors(processed: dict[str, Any]) -> dict[str, Any]:
    """Every processed tensor by `modality/index/name`, on the CPU."""
    out = {}
    for modality, items in processed["mm_kwargs"].items():
        for index, item in enumerate(items):
            for name, elem in item.items():
                data = elem.data
                out[f"{modality}/{index}/{name}"] = data.cpu() if hasattr(data, "cpu") else data
    return out
