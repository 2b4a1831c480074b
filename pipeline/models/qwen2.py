"""Qwen2: the Llama decoder with a bias on the q, k and v projections."""

import dataclasses

from ringllm.pipeline.models.hf_config import ArchConfig
from ringllm.pipeline.models.llama import LlamaForCausalLM
from ringllm.pipeline.models.registry import register


@register("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def adapt_config(cls, arch: ArchConfig) -> ArchConfig:
        return dataclasses.replace(arch, attention_bias=True)
