"""Reads model weights from safetensors files, one tensor (or one shard of it) at a time.

`WeightSource` indexes `model.safetensors` or a sharded `model.safetensors.index.json`
without reading any tensor data. `get(name, shard=...)` memory-maps the file and copies
only the requested slice into a fresh tensor, so loading never holds a second full copy
of the checkpoint, and a tensor-parallel rank reads only its own rows or columns:

    get("...q_proj.weight", Shard(dim=0, rank=1, size=2))   # rows [out/2, out)

Every failure names the file and the tensor: a missing file, a truncated or corrupt
safetensors header, a missing tensor, a shape the architecture does not expect.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open


@dataclass(frozen=True)
class Shard:
    """The slice of a tensor one tensor-parallel rank owns: equal parts along `dim`.

    `padded`: the extent need not divide by `size`; each part is ceil(extent / size) long
    and the last parts come back short (or empty): the caller pads them (vocab-parallel
    embedding and LM head).
    """

    dim: int
    rank: int
    size: int
    padded: bool = False


class WeightSource:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.exists():
            self._read_index(index)
        elif single.exists():
            for name in self._open(single).keys():
                self._file_of[name] = single
        else:
            raise FileNotFoundError(
                f"no weights in {self.folder}: expected model.safetensors or model.safetensors.index.json"
            )

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{index}: not a valid safetensors index ({exc})") from None
        for name, file_name in weight_map.items():
            path = self.folder / file_name
            if not path.exists():
                raise FileNotFoundError(
                    f"{index} names {file_name} for {name!r}, but the file is missing"
                )
            self._file_of[name] = path

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise ValueError(
                    f"{path}: cannot read safetensors file ({exc}); is it truncated?"
                ) from None
        return self._handles[path]

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(
        self, name: str, shard: Shard | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Reads tensor `name` (only `shard` of it if given); checks the full shape if given."""
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} is missing from the weights in {self.folder}")
        path = self._file_of[name]
        view = self._open(path).get_slice(name)
        full_shape = tuple(view.get_shape())
        if shape is not None and full_shape != tuple(shape):
            raise ValueError(
                f"{path.name}: tensor {name!r} has shape {full_shape}, the config implies {shape}"
            )
        try:
            if shard is None or shard.size == 1:
                return view[:]
            return view[_shard_index(full_shape, shard, name)]
        except Exception as exc:
            raise ValueError(
                f"{path}: cannot read tensor {name!r} ({exc}); is the file truncated?"
            ) from None


def _shard_index(full_shape: tuple[int, ...], shard: Shard, name: str) -> tuple[slice, ...]:
    extent = full_shape[shard.dim]
    if shard.padded:
        part = -(-extent // shard.size)
        index = [slice(None)] * len(full_shape)
        index[shard.dim] = slice(
            min(extent, shard.rank * part), min(extent, (shard.rank + 1) * part)
        )
        return tuple(index)
    if extent % shard.size:
        raise ValueError(
            f"tensor {name!r}: dim {shard.dim} of size {extent} does not split into {shard.size} equal shards"
        )
    part = extent // shard.size
    index = [slice(None)] * len(full_shape)
    index[shard.dim] = slice(shard.rank * part, (shard.rank + 1) * part)
    return tuple(index)


class RandomWeights:
    """`--load-format dummy`: every tensor made at random, on the device, in the shape the
    model asks for (only config.json is read). For benchmarks of large shapes without
    checkpoints: numerics are meaningless, speed is real. Norm weights are near 1 and
    matrices scaled by 1/sqrt(fan_in), so activations stay finite through every layer.
    """

    def __init__(self, seed: int, device: str) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __contains__(self, name: str) -> bool:
        return name != "lm_head.weight"  # tie the head: one vocab matrix fewer to make

    def get(
        self, name: str, shard: Shard | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        if shape is None:
            raise ValueError(f"random weights need the shape of {name!r}")
        shape = list(shape)
        if shard is not None and shard.size > 1:
            shape[shard.dim] //= shard.size
        if len(shape) == 1:
            out = torch.ones(shape, device=self.device)
            return out.add_(
                torch.randn(shape, generator=self.generator, device=self.device), alpha=0.02
            )
        out = torch.randn(shape, generator=self.generator, device=self.device)
        return out.mul_(shape[-1] ** -0.5)
