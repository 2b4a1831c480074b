"""Shared fixtures: tiny random-weight models of each architecture, made once per session."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from ringllm.tools.make_model import ModelShape, make_model


@contextlib.contextmanager
def environment(**values: str):
    """These environment variables set for what starts inside (a child inherits them),
    then put back as they were: for module-scoped fixtures, where monkeypatch is not."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


# Each variant exercises a different loader / model path.
MODEL_VARIANTS = {
    "llama": ModelShape(arch="llama", rope_scaling="llama3", tie_word_embeddings=True),
    "mistral": ModelShape(arch="mistral", num_kv_heads=4, num_shards=3),
    "qwen2": ModelShape(arch="qwen2", config_style="new", num_kv_heads=1),
    "qwen3": ModelShape(arch="qwen3", head_dim=32, rope_scaling="linear", config_style="new"),
    # five sliding layers of 16 keys to one global (the prompts of test_models.py cross the
    # window in prefill chunks and in decode), a soft-capped head
    "gemma3": ModelShape(
        arch="gemma3",
        num_layers=6,
        num_kv_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
        sliding_window=16,
        final_logit_softcapping=20.0,
        config_style="new",
    ),
    # fused qkv / gate_up, Phi-4-mini's partial rotary (12 of 16 dims) and LongRoPE with
    # its short factors (the sequences stay inside the original context)
    "phi3": ModelShape(
        arch="phi3",
        partial_rotary_factor=0.75,
        rope_scaling="longrope",
        config_style="new",
    ),
    # 8 experts, 2 per token, renormalized; the first layer keeps a dense MLP
    "qwen3_moe": ModelShape(
        arch="qwen3_moe", num_layers=3, head_dim=32, mlp_only_layers=(0,), config_style="new"
    ),
    # 4 experts, 2 per token (always renormalized)
    "mixtral": ModelShape(arch="mixtral", num_experts=4, num_kv_heads=2),
}


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def make(name: str = "llama", **overrides) -> Path:
        key = (name, tuple(sorted(overrides.items())))
        if key not in made:
            shape = ModelShape(**{**MODEL_VARIANTS[name].__dict__, **overrides})
            made[key] = make_model(tmp_path_factory.mktemp(f"model_{name}"), shape)
        return made[key]

    return make


def _children_of(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != b"Z" and not _is_resource_tracker(entry):
                children.append(int(entry))
    return children


def _is_resource_tracker(pid: str) -> bool:
    """multiprocessing's resource tracker lives as long as the test process: not a leak."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return False


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """After the whole suite: no ringllm segment of this run in /dev/shm, no child process."""
    from ringllm.ipc.liveness import is_process_alive
    from ringllm.ipc.shm import cleanup_stale, list_segments

    cleanup_stale()
    before = set(list_segments())
    yield
    deadline = time.monotonic() + 10  # engine processes told to stop may still be exiting
    while time.monotonic() < deadline and _children_of(os.getpid()):
        time.sleep(0.1)
    assert not _children_of(os.getpid()), "the tests left child processes running"
    left = sorted(set(list_segments()) - before)
    mine_or_dead = [
        name
        for name in left
        if int(name.split("_")[1]) == os.getpid() or not is_process_alive(int(name.split("_")[1]))
    ]
    assert not mine_or_dead, f"ringllm segments left in /dev/shm by the tests: {mine_or_dead}"


def make_peft_adapter(base, out, seed: int, b_std: float = 0.05, **config) -> None:
    """A PEFT LoRA adapter of the model at `base`, saved into `out` by PEFT itself: A as PEFT
    draws it (seeded), B normal with `b_std` (not PEFT's zeros, so the adapter changes the
    outputs). `config`: peft.LoraConfig's fields (r, lora_alpha, target_modules...)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, b_std)
    model.save_pretrained(out)
