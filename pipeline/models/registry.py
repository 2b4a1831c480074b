"""Architecture registry: `config.json`'s `architectures[0]` -> model class.

A new architecture is one module in this package that decorates its class with
`@register("NameForCausalLM")`; every module here is imported on first lookup, so
nothing else needs editing.
"""

from __future__ import annotations

import importlib
import pkgutil

_MODEL_CLASSES: dict[str, type] = {}


def register(architecture: str):
    def wrap(cls: type) -> type:
        _MODEL_CLASSES[architecture] = cls
        return cls

    return wrap


def _import_all() -> None:
    import ringllm.pipeline.models as package

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")


def model_class(architecture: str) -> type:
    if architecture not in _MODEL_CLASSES:
        _import_all()
    if architecture not in _MODEL_CLASSES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {supported_architectures()}"
        )
    return _MODEL_CLASSES[architecture]


def supported_architectures() -> list[str]:
    _import_all()
    return sorted(_MODEL_CLASSES)
