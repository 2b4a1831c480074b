"""ringllm.pipeline: the engine, one folder per process role.

    from ringllm.pipeline import LLM, SamplingParams       # offline
    from ringllm.pipeline import AsyncLLM, LLMEngine        # asyncio / step-by-step
    from ringllm.pipeline import Client                     # another process's engine, over the rings

    frontend/  tokenizer, chat template, prompts, outputs, LLM / LLMEngine / AsyncLLM, Client
    engine/    the engine core, its process loop, the clients that reach it, its wire records
    core/      scheduler, requests, admission, KV cache manager, block pool
    worker/    worker, model runner, input batch, model loading, tensor-parallel ranks
    sample/    sampler, logits filters
    models/    model code and loading; ops/ the hot ops (torch reference, C kernels)
    *.py       types every role shares: config, sampling params, outputs, stats, errors

docs/architecture.md draws it. The names below are loaded on first use, so a process that
imports only a part (the engine core, a worker rank) does not load the front end.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "ringllm.pipeline.frontend.llm",
    "LLMEngine": "ringllm.pipeline.frontend.llm_engine",
    "AsyncLLM": "ringllm.pipeline.frontend.async_llm",
    "Client": "ringllm.pipeline.frontend.client",
    "BeamSearchOutput": "ringllm.pipeline.frontend.beam_search",
    "BeamSearchParams": "ringllm.pipeline.frontend.beam_search",
    "EngineConfig": "ringllm.pipeline.config",
    "LoRARequest": "ringllm.pipeline.lora_request",
    "CompletionOutput": "ringllm.pipeline.outputs",
    "Logprob": "ringllm.pipeline.outputs",
    "RequestOutput": "ringllm.pipeline.outputs",
    "RequestOutputKind": "ringllm.pipeline.sampling_params",
    "SamplingParams": "ringllm.pipeline.sampling_params",
    "StructuredOutputsParams": "ringllm.pipeline.structured.params",
    "EngineDeadError": "ringllm.pipeline.errors",
    "EmbeddingRequestOutput": "ringllm.pipeline.outputs",
    "ScoringRequestOutput": "ringllm.pipeline.outputs",
    "DEMO_MODEL_NAME": "ringllm.pipeline.models.demo_model",  # what the API calls it
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ringllm.pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
