"""LoRA adapters as the front ends name them: `LoRARequest` (vLLM's) and the registry of
those loaded.

A request runs with an adapter when it is generated with `lora_request=LoRARequest(name,
id, path)` (the OpenAI server: its `model` is the adapter's name). The front end loads an
adapter once, in every worker (the engine core's `add_lora` control), and from then on a
request carries only the adapter's id (`SamplingParams.lora_id`, across the rings).

Prefix caching never shares blocks between adapters, nor between an adapter and the base
model: a request's cache salt (its first block's hash key) is mixed with a digest of the
adapter's files, so an adapter unloaded and another loaded under the same id (or the disk
KV tier read again after a restart) cannot find the old one's blocks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

DIGEST_BYTES = 16
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's, in that order


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # >= 1; 0 is the base model
    lora_path: str
    base_model_name: str | None = None  # the served model it adapts (several models)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name: must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id: must be an int, got {self.lora_int_id!r}")
        if not 1 <= self.lora_int_id < 2**31:
            raise ValueError(f"lora_int_id: must be in [1, 2**31), got {self.lora_int_id}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path: must be a non-empty string")


def adapter_digest(path: str | Path) -> bytes:
    """16 bytes of BLAKE2b over the adapter's config and weights files (what it computes)."""
    folder = Path(path)
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for name in ("adapter_config.json", *WEIGHT_FILES):
        file = folder / name
        if file.is_file():
            h.update(name.encode())
            with open(file, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.digest()


def lora_salt(cache_salt: bytes, digest: bytes) -> bytes:
    """The cache salt of a request with an adapter: its own salt (b"": none) mixed with
    the adapter's digest."""
    return hashlib.blake2b(cache_salt + b"lora" + digest, digest_size=DIGEST_BYTES).digest()


@dataclass
class LoadedLora:
    request: LoRARequest
    digest: bytes = field(repr=False)


class LoraRegistry:
    """The adapters a front end has loaded in its engine: by id and by name."""

    def __init__(self) -> None:
        self.by_id: dict[int, LoadedLora] = {}

    def __len__(self) -> int:
        return len(self.by_id)

    def by_name(self, name: str) -> LoadedLora | None:
        return next((e for e in self.by_id.values() if e.request.lora_name == name), None)

    def check_new(self, request: LoRARequest) -> None:
        """ValueError if its name or id is taken by another adapter."""
        same_id = self.by_id.get(request.lora_int_id)
        if same_id is not None:
            raise ValueError(
                f"LoRA adapter {same_id.request.lora_name!r} is loaded under id "
                f"{request.lora_int_id} already"
            )
        if self.by_name(request.lora_name) is not None:
            raise ValueError(f"a LoRA adapter named {request.lora_name!r} is loaded already")

    def add(self, request: LoRARequest, digest: bytes) -> None:
        self.by_id[request.lora_int_id] = LoadedLora(request, digest)

    def remove(self, lora_id: int) -> LoadedLora | None:
        return self.by_id.pop(lora_id, None)

    def salt(self, lora_id: int, cache_salt: bytes) -> bytes:
        entry = self.by_id.get(lora_id)
        if entry is None:
            raise ValueError(f"lora id {lora_id}: no such adapter is loaded")
        return lora_salt(cache_salt, entry.digest)

    def control_text(self, request: LoRARequest) -> str:
        """The `add_lora` control's JSON text (the engine core's)."""
        return json.dumps(
            {"path": str(Path(request.lora_path).resolve()), "name": request.lora_name}
        )
