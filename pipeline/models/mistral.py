"""Mistral: the Llama decoder unchanged; where config.json has a `sliding_window`, every
layer's queries see their last `sliding_window` keys (the Llama decoder takes the window)."""

from ringllm.pipeline.models.llama import LlamaForCausalLM
from ringllm.pipeline.models.registry import register


@register("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    pass
