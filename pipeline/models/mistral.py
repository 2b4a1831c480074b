"""Mistral: the Llama decoder unchanged (its sliding window is handled by the loader,
which refuses contexts longer than the window rather than attend past it)."""

from ringllm.pipeline.models.llama import LlamaForCausalLM
from ringllm.pipeline.models.registry import register


@register("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    pass
