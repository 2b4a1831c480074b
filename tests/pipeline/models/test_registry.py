"""The architecture registry (pipeline/models/registry.py): its table of modules is the
classes' own `@register`s, and checking an architecture imports no model module."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import ringllm.pipeline.models as models
from ringllm.pipeline.models import registry


def test_the_table_names_each_registered_class_and_its_module() -> None:
    for info in pkgutil.iter_modules(models.__path__):
        importlib.import_module(f"{models.__name__}.{info.name}")
    registered = dict(registry._MODEL_CLASSES)
    assert set(registered) == set(registry.ARCHITECTURE_MODULES)
    for name, cls in registered.items():
        assert cls.__module__ == f"{models.__name__}.{registry.ARCHITECTURE_MODULES[name]}"
        assert registry.model_class(name) is cls


def test_an_unknown_architecture_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: .*Llama"):
        registry.check_architecture("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="not supported"):
        registry.model_class("GPT2LMHeadModel")


def test_checking_a_model_imports_no_torch(tmp_path) -> None:
    """What `ringllm serve`'s front end runs before it starts the engine (a process that
    never runs a model, ~200 MiB lighter without torch): the CLI, the model check on an HF
    folder, the device's resolution."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, '
        '"intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, '
        '"num_key_value_heads": 1}'
    )
    code = (
        "import sys\n"
        "from ringllm.tools.cli import build_parser\n"
        "from ringllm.pipeline.engine.engine_core_proc import check_model\n"
        "build_parser('serve')\n"
        f"check_model({str(folder)!r}, 1)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
