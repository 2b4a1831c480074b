"""Architecture registry: `config.json`'s `architectures[0]` -> model class.

A new architecture is a module in this package that decorates its class with
`@register("NameForCausalLM")`, and one line in ARCHITECTURE_MODULES naming that module
(tests/pipeline/models/test_registry.py holds the two to each other). A lookup imports only
the module of the architecture asked for: the model modules bring torch, and a front end
that checks a model's architecture before any process loads it (`ringllm serve`) needs none.
"""

from __future__ import annotations

import importlib

_MODEL_CLASSES: dict[str, type] = {}

# architecture -> the module of this package whose class registers it
ARCHITECTURE_MODULES = {
    "BertModel": "bert",
    "Gemma3ForCausalLM": "gemma3",
    "LlamaForCausalLM": "llama",
    "LlavaForConditionalGeneration": "llava",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "moe",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "moe",
}


def register(architecture: str):
    def wrap(cls: type) -> type:
        _MODEL_CLASSES[architecture] = cls
        return cls

    return wrap


def check_architecture(architecture: str) -> None:
    """ValueError unless ringllm has a model class for `architecture` (nothing imported)."""
    if architecture not in ARCHITECTURE_MODULES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {supported_architectures()}"
        )


def model_class(architecture: str) -> type:
    check_architecture(architecture)
    if architecture not in _MODEL_CLASSES:
        importlib.import_module(f"{__package__}.{ARCHITECTURE_MODULES[architecture]}")
    return _MODEL_CLASSES[architecture]


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURE_MODULES)
