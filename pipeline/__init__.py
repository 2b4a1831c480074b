"""ringllm.pipeline: configs, requests, scheduling, KV cache, model running, offline API.

from ringllm.pipeline import LLM, SamplingParams
"""

from ringllm.pipeline.beam_search import BeamSearchOutput, BeamSearchParams
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.llm import LLM
from ringllm.pipeline.llm_engine import LLMEngine
from ringllm.pipeline.outputs import CompletionOutput, Logprob, RequestOutput
from ringllm.pipeline.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
