"""Qwen3: the Llama decoder with an RMSNorm over each head of q and k before rotary."""

import dataclasses

from ringllm.pipeline.models.hf_config import ArchConfig
from ringllm.pipeline.models.llama import LlamaForCausalLM
from ringllm.pipeline.models.registry import register


@register("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def adapt_config(cls, arch: ArchConfig) -> ArchConfig:
        return dataclasses.replace(arch, qk_norm=True)
